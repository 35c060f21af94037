"""The llama_cpp role on hosts without root (issue 22): the clone, the cmake trees, the builds
and the guard of each long step live in the login user's folders (Layout: prefix, cache, run);
no command goes through sudo; a Termux build is portable (-DGGML_NATIVE=OFF) unless the file
names GGML_NATIVE, and the build key says so. The guarded clone runs for real as a user without
root (nobody) in folders that user owns."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support import golden
from support.nonroot import as_user, give, owned_folder
from support.steps import decided
from support.require import require
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.model import RUNIT, Layout
from meshdeploy.core import account
from meshdeploy.core.context import HostContext
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.llama_cpp import settings

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "rootless"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
TERMUX_USER = ["home=/data/data/com.termux/files/home", "user=u0_a123", "uid=10123", "sv=yes",
               "runsvdir=runsvdir -P /data/data/com.termux/files/usr/var/service", "termux_prefix=/data/data/com.termux/files/usr"]
DEBIAN_USER = ["home=/home/md", "user=md", "uid=1000", "systemd_user=running", "linger=yes",
               "runtime=/run/user/1000"]
SUDO = re.compile(r"(^|[^\w-])sudo([^\w-]|$)")
# Absolute paths a command names: not the tails of "$VAR/..." or ${VAR%/*}, a URL's path, or
# awk's '/regex/' (the paths here hold no character that would quote them).
ABSOLUTE = re.compile(r"(?<![\w$}%#.:/'-])/[\w.-][\w./-]*")


def cluster_text(build: str = "") -> str:
    return ("cluster: t\nllama_cpp:\n  ref: b1\n" + build +
            "network:\n  firewall: false\nhosts:\n  node1:\n    address: 10.0.0.1\n"
            "  phone:\n    address: 10.0.0.2\n    rootless: true\n"
            "    rpc_servers:\n      - port: 50052\n"
            "models:\n  m: {path: /m.gguf}\n"
            "servers:\n  main: {host: node1, model: m}\n")


def cluster_with(tmp_path: Path, layout: Layout, build: str = ""):
    path = tmp_path / "c.yaml"
    path.write_text(cluster_text(build))
    return account.resolved(load_cluster(path), {"phone": layout})


def read_layout(lines) -> Layout:
    return account.layout(account.parse("phone", lines))


def context(cluster, host: str = "phone", termux: bool = True, facts=None) -> HostContext:
    platform = {"kernel": "Linux", "tools": [], "termux": termux}
    return HostContext(cluster, cluster.host(host), {"toolchain.Platform": platform,
                                                     **(facts or {})},
                       run_values(commit=COMMIT, build_number=11312))


def outside(commands: list[str], layout: Layout) -> list[str]:
    """Absolute paths the commands name that lie outside the layout's folders."""
    roots = (layout.prefix, layout.cache, layout.run)
    found = {p for c in commands for p in ABSOLUTE.findall(c)}
    return sorted(p for p in found if p != "/dev/null" and not any(
        p == r or p.startswith(r + "/") for r in roots))


def test_a_termux_build_stays_in_the_users_folders_without_sudo_golden(tmp_path):
    layout = read_layout(TERMUX_USER)
    cluster = cluster_with(tmp_path, layout, "  build: {ccache: true}\n")
    ctx = context(cluster)
    step = llama_cpp.build(ctx)
    key = llama_cpp.build_key(cluster, ctx.host, COMMIT, termux=True)
    assert step.build.key == key and step.change.action == "create"
    assert step.sudo is False
    assert not [c for c in step.commands if SUDO.search(c)]
    assert outside(step.commands, layout) == []
    text = "\n".join(step.commands)
    home = "/data/data/com.termux/files/home"
    assert f"SRC={home}/.local/share/meshdeploy/src/llama.cpp" in text
    assert f"OUT={home}/.local/share/meshdeploy/builds/{key}" in text
    assert f"CCACHE={home}/.cache/meshdeploy/ccache" in text  # the user's cache, not root's
    assert f"DIR={home}/.cache/meshdeploy/run/steps" in text  # no XDG_RUNTIME_DIR on Termux
    assert "/run/meshdeploy" not in text and "/opt/meshdeploy" not in text
    assert "'-DGGML_NATIVE=OFF'" in text or " -DGGML_NATIVE=OFF " in text
    golden.check(GOLDEN / "llama-cpp-termux-build.txt", text + "\n")


def test_the_clone_on_a_rootless_linux_host_is_guarded_in_its_runtime_folder(tmp_path):
    layout = read_layout(DEBIAN_USER)
    cluster = cluster_with(tmp_path, layout)
    step = llama_cpp.source(context(cluster, termux=False))
    assert step.change.action == "create" and step.sudo is False
    assert not [c for c in step.commands if SUDO.search(c)]
    assert outside(step.commands, layout) == []
    text = "\n".join(step.commands)
    assert "DIR=/run/user/1000/meshdeploy/steps" in text
    assert "SRC=/home/md/.local/share/meshdeploy/src/llama.cpp" in text
    # Moving the pin of an existing clone: plain git as the user, in the user's prefix.
    moved = llama_cpp.source(context(cluster, termux=False, facts={"llama_cpp.Source": {
        "head": "1" * 40, "url": settings.of(cluster).repo, "has_commit": False}}))
    assert moved.sudo is False and outside(moved.commands, layout) == []
    assert all(c.startswith("git ") for c in moved.commands)


def test_switching_to_an_installed_build_needs_no_sudo(tmp_path):
    layout = read_layout(DEBIAN_USER)
    cluster = cluster_with(tmp_path, layout)
    key = llama_cpp.build_key(cluster, cluster.host("phone"), COMMIT)
    builds = {"current": "old", "builds": {key: {"commit": COMMIT, "rpc_binary": "ggml-rpc-server",
                                                 "targets": "llama-server ggml-rpc-server"},
                                           "old": {"commit": "2" * 40}}}
    step = llama_cpp.build(context(cluster, termux=False, facts={"llama_cpp.Builds": builds}))
    assert step.change.action == "update" and step.sudo is False
    assert outside(step.commands, layout) == []


def test_termux_builds_are_portable_unless_the_file_says_otherwise(tmp_path):
    cluster = cluster_with(tmp_path, read_layout(TERMUX_USER))
    phone = cluster.host("phone")
    assert "-DGGML_NATIVE=OFF" in llama_cpp.cmake_flags(cluster, phone, termux=True)
    assert "-DGGML_NATIVE=OFF" not in llama_cpp.cmake_flags(cluster, phone, termux=False)
    # The flag makes another build: its key differs (an installed native build is not reused).
    assert llama_cpp.build_key(cluster, phone, COMMIT, termux=True) != \
        llama_cpp.build_key(cluster, phone, COMMIT)
    for told in ('["-DGGML_NATIVE=ON"]', '["-DGGML_NATIVE:BOOL=ON"]'):
        other = cluster_with(tmp_path, read_layout(TERMUX_USER),
                             f"  build: {{cmake_flags: {told}}}\n")
        flags = llama_cpp.cmake_flags(other, other.host("phone"), termux=True)
        assert "-DGGML_NATIVE=OFF" not in flags, told
    # The flag once, where the file also gives it (the android inventory does).
    given = cluster_with(tmp_path, read_layout(TERMUX_USER),
                         '  build: {cmake_flags: ["-DGGML_NATIVE=OFF"]}\n')
    assert llama_cpp.cmake_flags(given, given.host("phone"), termux=True).count(
        "-DGGML_NATIVE=OFF") == 1


def test_ccache_folder_and_what_destroy_reads(tmp_path):
    layout = read_layout(DEBIAN_USER)
    cluster = cluster_with(tmp_path, layout, "  build: {ccache: true}\n")
    phone, node1 = cluster.host("phone"), cluster.host("node1")
    assert llama_cpp.ccache_dir(cluster, phone) == "/home/md/.cache/meshdeploy/ccache"
    assert llama_cpp.ccache_dir(cluster, node1) == ""  # root: ccache's own default, as before
    [section] = llama_cpp.destroy_sections(cluster, phone)
    assert "/home/md/.cache/meshdeploy/ccache" in section.kwargs["paths"]
    assert all(p.startswith("/home/md/") for p in section.kwargs["paths"])
    [section] = llama_cpp.destroy_sections(cluster, node1)
    assert not [p for p in section.kwargs["paths"] if "ccache" in p]
    named = cluster_with(tmp_path, layout, "  build: {ccache: true, ccache_dir: /srv/cc}\n")
    assert llama_cpp.ccache_dir(named, named.host("phone")) == "/srv/cc"
    [section] = llama_cpp.destroy_sections(named, named.host("phone"))
    assert "/srv/cc" not in section.kwargs["paths"]  # the file's folder is shared: it stays


def test_a_host_with_root_builds_as_before(tmp_path):
    cluster = cluster_with(tmp_path, read_layout(TERMUX_USER))
    ctx = context(cluster, host="node1", termux=False)
    step = llama_cpp.build(ctx)
    assert step.sudo is True
    text = "\n".join(step.commands)
    assert "DIR=/run/meshdeploy/steps" in text
    assert "SRC=/opt/meshdeploy/src/llama.cpp" in text and "CCACHE=''" in text
    # The checks above can fail: on these commands they would.
    assert "/opt/meshdeploy/src/llama.cpp" in outside(step.commands, read_layout(TERMUX_USER))
    assert SUDO.search("sudo -n true") and not SUDO.search("pseudo-terminal")


# -- for real, as a user without root ---------------------------------------------------------

def test_the_guarded_clone_runs_without_root(tmp_path):
    require("git", "flock")
    base = owned_folder()
    try:
        upstream = base / "upstream"
        git = ["git", "-C", str(upstream), "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run(["git", "init", "-q", str(upstream)], check=True)
        subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "x"], check=True)
        head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        give(base)
        layout = Layout(prefix=f"{base}/share/meshdeploy", cache=f"{base}/cache/meshdeploy",
                        run=f"{base}/runtime/meshdeploy", services=f"{base}/service",
                        manager=RUNIT, home=str(base))
        path = tmp_path / "c.yaml"
        path.write_text(cluster_text().replace("ref: b1", f"ref: {head}\n  repo: {upstream}"))
        cluster = account.resolved(load_cluster(path), {"phone": layout})
        ctx = decided(HostContext(cluster, cluster.host("phone"), {},
                                  run_values(commit=head)))
        [command] = llama_cpp.source(ctx).commands
        env = {"PATH": os.environ["PATH"], "HOME": str(base)}
        out = subprocess.run(as_user(["sh", "-c", command]), capture_output=True, text=True,
                             env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        src = Path(layout.prefix) / "src" / "llama.cpp"
        cloned = subprocess.run(["git", "-c", f"safe.directory={src}", "-C", str(src),
                                 "rev-parse", "HEAD"], capture_output=True, text=True)
        assert cloned.stdout.strip() == head
        # The step's lock and pid file are in the user's run folder, and the user's.
        steps = Path(layout.run) / "steps"
        assert sorted(p.name for p in steps.iterdir()) == ["llama_cpp.source.lock",
                                                          "llama_cpp.source.pid"]
        owner = os.stat(steps / "llama_cpp.source.lock").st_uid
        assert owner != 0 and owner == os.stat(base).st_uid
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_connection_to_a_rootless_host_runs_nothing_through_sudo(tmp_path):
    """pyinfra runs a step that names no _sudo as its host data says: a rootless host's ssh.sudo
    keeps its default (true), so that data must come from Host.sudo (before: every step of the
    host went through sudo -n, refused there)."""
    from meshdeploy.remote import ssh_settings

    cluster = cluster_with(tmp_path, read_layout(DEBIAN_USER))
    phone = cluster.host("phone")
    assert phone.ssh.sudo is True and phone.sudo is False
    assert ssh_settings.resolve(phone, home=str(tmp_path)).pyinfra_data()["_sudo"] is False
    assert ssh_settings.resolve(cluster.host("node1"),
                                home=str(tmp_path)).pyinfra_data()["_sudo"] is True


def test_a_ccache_dir_the_user_cannot_write_is_refused_before_the_build(tmp_path):
    """The file's ccache_dir applies to every host; a rootless host builds as its user, so a
    root-owned one would fail every compile: the probe asks as that user, preflight refuses."""
    from meshdeploy.errors import PlanError
    from meshdeploy.roles.llama_cpp.facts import CcacheWritable

    mine = owned_folder()
    try:
        roots = tmp_path / "root-only"
        roots.mkdir(mode=0o700)

        def writable(path: str) -> bool:
            out = subprocess.run(as_user(["sh", "-c", CcacheWritable().command(path)]),
                                 capture_output=True, text=True)
            return CcacheWritable().process(out.stdout.splitlines())

        assert writable(str(mine)) and writable(f"{mine}/not/yet/made")
        assert not writable(str(roots)) and not writable(f"{roots}/ccache")
        layout = read_layout(DEBIAN_USER)
        cluster = cluster_with(tmp_path, layout,
                               f"  build: {{ccache: true, ccache_dir: '{roots}/ccache'}}\n")
        keys = [s.key for s in llama_cpp.sections(cluster, cluster.host("phone"), COMMIT, False)]
        assert "llama_cpp.CcacheWritable" in keys
        assert "llama_cpp.CcacheWritable" not in [
            s.key for s in llama_cpp.sections(cluster, cluster.host("node1"), COMMIT, False)]
        with pytest.raises(PlanError, match="is rootless and cannot write"):
            llama_cpp.preflight(context(cluster, termux=False, facts={
                "llama_cpp.CcacheWritable": writable(f"{roots}/ccache")}))
        llama_cpp.preflight(context(cluster, termux=False, facts={
            "llama_cpp.CcacheWritable": writable(f"{mine}/ccache")}))
    finally:
        shutil.rmtree(mine, ignore_errors=True)
