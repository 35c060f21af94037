"""The toolchain role on hosts without root (issue 22): a rootless Linux host is never given a
package step (nothing can be installed without root), only refused at preflight with the exact
list and the one command an administrator runs; a Termux host gets `pkg install` of the Termux
packages of what it lacks (golden: no phone runs here); nothing goes through sudo, and no apt
proxy file is read or written on either."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from support import golden
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import account
from meshdeploy.core.context import HostContext
from meshdeploy.errors import PlanError
from meshdeploy.roles.toolchain import operations as toolchain
from meshdeploy.roles.toolchain.facts import Platform

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "rootless"

# What core.account reads on the two kinds of rootless host.
DEBIAN_USER = ["home=/home/md", "user=md", "uid=1000", "systemd_user=running", "linger=yes",
               "runtime=/run/user/1000"]
TERMUX_USER = ["home=/data/data/com.termux/files/home", "user=u0_a123", "uid=10123", "sv=yes",
               "runsvdir=runsvdir -P /data/data/com.termux/files/usr/var/service", "termux_prefix=/data/data/com.termux/files/usr"]

ALL_TOOLS = ["apt-get", "c++", "cc", "cmake", "curl", "g++", "git", "ninja", "python3",
             "sha256sum", "flock", "setsid", "getconf"]
ALL_DEBS = {p: True for p in ("cmake", "g++", "git", "curl", "ca-certificates", "ninja-build",
                             "python3")}  # python3: node1's md-failover


def cluster_file(tmp_path: Path, build: str = "", proxy: str = "") -> Path:
    path = tmp_path / "c.yaml"
    path.write_text("cluster: t\nllama_cpp:\n  ref: b1\n" + build + proxy +
                    "network:\n  firewall: false\nhosts:\n  node1:\n    address: 10.0.0.1\n"
                    "  phone:\n    address: 10.0.0.2\n    rootless: true\n"
                    "    rpc_servers:\n      - port: 50052\n"
                    "models:\n  m: {path: /m.gguf}\n"
                    "servers:\n  main: {host: node1, model: m}\n")
    return path


def context(tmp_path, platform: dict, debs: dict | None = None, lines=DEBIAN_USER,
            build: str = "", proxy: str = "", host: str = "phone") -> HostContext:
    cluster = load_cluster(cluster_file(tmp_path, build, proxy))
    cluster = account.resolved(cluster, {"phone": account.layout(account.parse("phone", lines))})
    facts = {"toolchain.Platform": {"kernel": "Linux", "cmake_version": (3, 25, 1),
                                    "termux": False, **platform},
             "toolchain.DebPackages": debs if debs is not None else {}}
    return HostContext(cluster, cluster.host(host), facts, run_values(commit=None))


def refusal(fn, ctx) -> PlanError:
    with pytest.raises(PlanError) as info:
        fn(ctx)
    return info.value


def test_a_rootless_debian_host_with_every_tool_has_no_step_and_no_proxy(tmp_path):
    ctx = context(tmp_path, {"tools": ALL_TOOLS}, ALL_DEBS,
                  proxy="toolchain:\n  apt_proxy: http://10.0.0.9:3142\n")
    assert toolchain.preflight(ctx) is None
    step = toolchain.packages(ctx)
    assert step.noop and step.commands == []
    assert step.change.reason == "cmake, g++, git, curl, ca-certificates, ninja-build present"
    proxy = toolchain.apt_proxy(ctx)
    assert proxy.noop and "not applied" in proxy.change.reason
    # Nothing of apt's configuration is read there either (the file is root's).
    keys = [s.key for s in toolchain.sections(ctx.cluster, ctx.host)]
    assert "toolchain.AptProxy" not in keys
    assert "toolchain.AptProxy" in [s.key for s in toolchain.sections(ctx.cluster,
                                                                      ctx.cluster.host("node1"))]


def test_a_tool_of_the_users_own_counts_as_present(tmp_path):
    """cmake from `pip install --user cmake` is on PATH though dpkg has no cmake package."""
    ctx = context(tmp_path, {"tools": ALL_TOOLS}, {**ALL_DEBS, "cmake": False})
    assert toolchain.packages(ctx).noop


def test_a_rootless_debian_host_that_lacks_packages_is_refused_with_the_admin_command(tmp_path):
    tools = [t for t in ALL_TOOLS if t not in ("ninja", "ccache")]
    debs = {**ALL_DEBS, "ninja-build": False}
    ctx = context(tmp_path, {"tools": tools}, debs, build="  build: {ccache: true}\n")
    error = refusal(toolchain.preflight, ctx)
    assert error.message == ("host phone has no root and lacks ninja-build, ccache: meshdeploy "
                             "cannot install packages there")
    assert error.hint == ("an administrator of the host runs, once: "
                          "sudo apt-get install -y ninja-build ccache")
    # The step itself never plans an install there: the same refusal.
    assert refusal(toolchain.packages, ctx).message == error.message


def test_a_package_without_a_tool_is_checked_through_dpkg(tmp_path):
    ctx = context(tmp_path, {"tools": ALL_TOOLS}, {**ALL_DEBS, "ca-certificates": False})
    assert refusal(toolchain.preflight, ctx).hint.endswith(
        "sudo apt-get install -y ca-certificates")


def test_a_rootless_fedora_host_names_dnf(tmp_path):
    tools = [t for t in ALL_TOOLS if t not in ("apt-get", "c++", "g++", "git")] + ["dnf"]
    error = refusal(toolchain.preflight, context(tmp_path, {"tools": tools}))
    assert error.message.startswith("host phone has no root and lacks gcc-c++, git:")
    assert error.hint == "an administrator of the host runs, once: sudo dnf install -y gcc-c++ git"


def test_a_rootless_host_without_apt_or_dnf_names_the_tools(tmp_path):
    tools = [t for t in ALL_TOOLS if t not in ("apt-get", "cmake")]
    error = refusal(toolchain.preflight, context(tmp_path, {"tools": tools}))
    assert error.message.startswith("host phone has no root and lacks cmake:")
    assert "installs cmake with its package manager" in error.hint
    # All there: no package manager is needed at all (a host with root would be refused).
    assert toolchain.preflight(context(tmp_path, {"tools": tools + ["cmake"]})) is None
    assert toolchain.packages(context(tmp_path, {"tools": tools + ["cmake"]})).noop


def test_termux_installs_what_is_missing_with_pkg_golden(tmp_path):
    # A fresh Termux: apt-get and dpkg are there (the app's own), no build tools.
    platform = {"tools": ["apt-get", "curl", "pkg"], "termux": True, "cmake_version": None}
    ctx = context(tmp_path, platform, lines=TERMUX_USER, build="  build: {ccache: true}\n")
    assert toolchain.preflight(ctx) is None  # Termux installs: nothing to refuse
    step = toolchain.packages(ctx)
    assert step.change.action == "create" and step.change.reason == "install with pkg (Termux)"
    assert step.sudo is False
    assert not any("sudo" in shlex.split(c) for c in step.commands)
    golden.check(GOLDEN / "toolchain-termux-pkg.txt", "\n".join(step.commands) + "\n")
    assert step.commands == ["pkg install -y cmake clang git ninja getconf util-linux ccache"]


def test_termux_with_every_tool_has_no_step(tmp_path):
    tools = ["apt-get", "pkg", "cmake", "c++", "cc", "git", "curl", "ninja", "getconf", "flock",
             "setsid"]
    ctx = context(tmp_path, {"tools": tools, "termux": True}, lines=TERMUX_USER)
    step = toolchain.packages(ctx)
    assert step.noop and step.commands == []


def test_termux_without_rootless_is_refused(tmp_path):
    ctx = context(tmp_path, {"tools": ALL_TOOLS + ["pkg"], "termux": True}, ALL_DEBS,
                  host="node1")
    error = refusal(toolchain.preflight, ctx)
    assert error.message == "host node1 runs Termux, where nothing has root"
    assert error.hint == "set hosts.node1.rootless: true"


def test_a_host_with_root_plans_apt_as_before(tmp_path):
    """The same facts on the file's host with root: apt through sudo, unchanged."""
    debs = {**ALL_DEBS, "ninja-build": False}
    step = toolchain.packages(context(tmp_path, {"tools": ALL_TOOLS}, debs, host="node1"))
    assert step.sudo is True
    assert step.commands == ["export DEBIAN_FRONTEND=noninteractive; apt-get update -qq && "
                             "apt-get install -y -qq --no-install-recommends ninja-build"]


@pytest.mark.parametrize("env, path, termux", [
    ({"PREFIX": "/data/data/com.termux/files/usr"}, "com.termux/files/usr/bin", True),
    ({}, "com.termux/files/usr/bin", True),  # sshd gave no PREFIX: pkg's own folder says it
    ({"TERMUX_VERSION": "0.118.1"}, "bin", True),
    ({}, "bin", False),  # a `pkg` of another system (FreeBSD's)
    ({"PREFIX": "/data/data/com.termux/files/usr"}, None, False),  # no pkg: nothing installs
])
def test_the_probe_tells_termux_from_its_pkg_and_prefix(tmp_path, env, path, termux):
    import subprocess

    search = []
    if path is not None:
        folder = tmp_path / path
        folder.mkdir(parents=True)
        (folder / "pkg").write_text("#!/bin/sh\n")
        (folder / "pkg").chmod(0o755)
        search.append(str(folder))
    clean = {"PATH": ":".join(search + ["/usr/bin", "/bin"]), **env}
    out = subprocess.run(["sh", "-c", Platform().command()], capture_output=True, text=True,
                         env=clean).stdout.splitlines()
    fact = Platform().process(out)
    assert fact["termux"] is termux
    assert fact["kernel"] == "Linux"
