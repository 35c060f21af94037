"""toolchain.packages on a host that copies its llama.cpp build (Resolved.build_copiers): on apt
it gets what the copy and the binaries need (curl, ca-certificates, libgomp1; git on the host
that resolves the ref; gcc and libc6-dev where md-rpc-seed is compiled), not cmake, g++ or
ninja; the host that compiles gets the whole toolchain, -replace'd or not; the preflight asks
no cmake of a copier; nothing is ever removed from a host that has more."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import account
from meshdeploy.core.context import HostContext
from meshdeploy.errors import PlanError
from meshdeploy.roles.llama_cpp import keys
from meshdeploy.roles.toolchain import operations as toolchain

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
FULL = ["cmake", "g++", "git", "curl", "ca-certificates", "ninja-build", "ccache"]


def lab(tmp_path: Path, cached_node2: bool = False):
    text = (ROOT / "inventories" / "lab.yaml").read_text()
    if cached_node2:  # node2's rpc-server caches tensors: md-rpc-seed is compiled there
        text = text.replace("      - port: 50052\n",
                            "      - port: 50052\n        cache: true\n", 1)
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    return load_cluster(path)


def bare(tools=("apt-get",), cmake=None, debs=None) -> dict:
    """A Debian 12 host's facts: the tools on PATH, its cmake, the Debian packages dpkg lists."""
    return {"toolchain.Platform": {"kernel": "Linux", "machine": "x86_64", "distro": "debian",
                                   "version": "12", "tools": sorted(tools),
                                   "cmake_version": cmake, "termux": False},
            "toolchain.DebPackages": dict(debs or {}), "llama_cpp.Libc": "glibc 2.36",
            "llama_cpp.Builds": {"current": None, "builds": {}}}


def contexts(cluster, facts: dict, replace=()) -> dict[str, HostContext]:
    """Every host's context as the plan makes it: the copiers from llama_cpp's prepare
    (keys.copiers), the first host of the run first."""
    copiers = keys.copiers(cluster, cluster.hosts, facts, COMMIT, replace)
    resolved = run_values(commit=COMMIT, build_copiers=copiers, replace=tuple(replace))
    return {h.name: HostContext(cluster, h, facts[h.name], resolved, cluster_facts=facts,
                                first=i == 0)
            for i, h in enumerate(cluster.hosts)}


def installs(ctx: HostContext) -> list[str]:
    """The packages toolchain.packages installs with apt on the host ([] for a no-op)."""
    step = toolchain.packages(ctx)
    if not step.commands:
        return []
    words = shlex.split(step.commands[0].split("; ", 1)[1])
    return words[words.index("--no-install-recommends") + 1:]


def test_a_copier_gets_only_what_the_copy_and_the_binaries_need(tmp_path):
    cluster = lab(tmp_path)
    ctxs = contexts(cluster, {h.name: bare() for h in cluster.hosts})
    for name in ("node2", "node3"):
        assert installs(ctxs[name]) == ["curl", "ca-certificates", "libgomp1"], name
        assert toolchain.packages(ctxs[name]).change.reason == \
            "install with apt; copies its llama.cpp build from node1: no compiler"


def test_the_builder_gets_the_whole_toolchain_while_its_copiers_do_not(tmp_path):
    cluster = lab(tmp_path)
    ctxs = contexts(cluster, {h.name: bare() for h in cluster.hosts})
    # python3: md-share serves its build (and its model copy) to the others.
    assert installs(ctxs["node1"]) == [*FULL, "python3"]
    assert toolchain.packages(ctxs["node1"]).change.reason == "install with apt"
    assert "cmake" not in installs(ctxs["node2"])


def test_a_replaced_host_compiles_with_the_whole_toolchain_and_the_first_copier_keeps_git(
        tmp_path):
    cluster = lab(tmp_path)
    ctxs = contexts(cluster, {h.name: bare() for h in cluster.hosts},
                    replace=("node2/llama_cpp.build",))
    assert ctxs["node2"].resolved.value("llama_cpp", "build_copiers") == {
        "node2": ("node1", "node3")}
    assert installs(ctxs["node2"]) == [*FULL, "python3"]
    # node1 copies now, and is the first host of the run: it resolves the ref (git ls-remote);
    # it orchestrates a server that may lose a worker: md-failover needs python3.
    assert installs(ctxs["node1"]) == ["curl", "ca-certificates", "libgomp1", "git", "python3"]
    assert installs(ctxs["node3"]) == ["curl", "ca-certificates", "libgomp1"]


def test_replace_of_every_build_leaves_no_copier(tmp_path):
    cluster = lab(tmp_path)
    ctxs = contexts(cluster, {h.name: bare() for h in cluster.hosts},
                    replace=("llama_cpp.build",))
    for name, ctx in ctxs.items():
        assert "cmake" in installs(ctx), name


def test_a_copier_that_compiles_md_rpc_seed_gets_a_c_compiler_and_the_headers(tmp_path):
    cluster = lab(tmp_path, cached_node2=True)
    ctxs = contexts(cluster, {h.name: bare() for h in cluster.hosts})
    assert installs(ctxs["node2"]) == ["curl", "ca-certificates", "libgomp1", "gcc", "libc6-dev"]
    assert installs(ctxs["node3"]) == ["curl", "ca-certificates", "libgomp1"]


def test_the_probe_asks_dpkg_for_every_package_either_kind_of_host_wants(tmp_path):
    cluster = lab(tmp_path, cached_node2=True)
    queried = {h.name: list(dict(((s.key, s) for s in toolchain.sections(cluster, h)))[
        "toolchain.DebPackages"].kwargs["packages"]) for h in cluster.hosts}
    # The cross compilers too: who compiles for an arm64 host is known once all are probed.
    cross = ["g++-aarch64-linux-gnu", "libc6-dev-arm64-cross"]
    assert queried["node3"] == [*FULL, *cross, "libgomp1"]
    assert queried["node2"] == [*FULL, *cross, "libgomp1", "gcc", "libc6-dev"]


def test_a_copier_with_the_whole_toolchain_installed_keeps_it(tmp_path):
    cluster = lab(tmp_path)
    everything = {p: True for p in [*FULL, "libgomp1", "python3"]}
    ctxs = contexts(cluster, {h.name: bare(debs=everything) for h in cluster.hosts})
    step = toolchain.packages(ctxs["node2"])
    assert step.noop and not step.commands
    assert step.change.reason == ("curl, ca-certificates, libgomp1 installed; copies its "
                                  "llama.cpp build from node1: no compiler")


def test_the_preflight_asks_no_cmake_of_a_copier(tmp_path):
    cluster = lab(tmp_path)
    old = ("apt-get", "cmake")
    ctxs = contexts(cluster, {h.name: bare(old, cmake=(3, 10, 2)) for h in cluster.hosts})
    for name in ("node2", "node3"):
        assert toolchain.preflight(ctxs[name]) is None
    with pytest.raises(PlanError, match="host node1 has cmake 3.10.2; llama.cpp needs >= 3.14"):
        toolchain.preflight(ctxs["node1"])
    replaced = contexts(cluster, {h.name: bare(old, cmake=(3, 10, 2)) for h in cluster.hosts},
                        replace=("node2/llama_cpp.build",))
    with pytest.raises(PlanError, match="host node2 has cmake 3.10.2"):
        toolchain.preflight(replaced["node2"])


def test_a_rootless_copier_without_cmake_is_not_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cluster: t\nllama_cpp:\n  ref: b1\nnetwork:\n  firewall: false\nhosts:\n"
                    "  node1:\n    address: 10.0.0.1\n"
                    + "".join(f"  {n}:\n    address: 10.0.0.{i}\n    rootless: true\n"
                              "    rpc_servers:\n      - port: 50052\n"
                              for i, n in ((2, "node2"), (3, "node3")))
                    + "models:\n  m: {path: /m.gguf}\nservers:\n  main: {host: node1, model: m}\n")
    lines = ["home=/home/md", "user=md", "uid=1000", "systemd_user=running", "linger=yes",
             "runtime=/run/user/1000"]
    cluster = account.resolved(load_cluster(path), {n: account.layout(account.parse(n, lines))
                                                    for n in ("node2", "node3")})
    debs = {"curl": True, "ca-certificates": True, "libgomp1": True}
    facts = {h.name: bare(("apt-get", "curl"), debs=debs) for h in cluster.hosts}
    ctxs = contexts(cluster, facts)
    assert ctxs["node2"].resolved.value("llama_cpp", "build_copiers") == {
        "node1": ("node2", "node3")}
    assert toolchain.preflight(ctxs["node2"]) is None
    step = toolchain.packages(ctxs["node2"])
    assert step.noop and step.change.reason == ("curl, ca-certificates, libgomp1 present; copies "
                                                "its llama.cpp build from node1: no compiler")
    # Without libgomp1 the copied binaries would not start: an administrator installs it.
    facts["node3"] = bare(("apt-get", "curl"), debs={"curl": True, "ca-certificates": True})
    with pytest.raises(PlanError, match="host node3 has no root and lacks libgomp1:"):
        toolchain.preflight(contexts(cluster, facts)["node3"])
