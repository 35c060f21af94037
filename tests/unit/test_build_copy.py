"""One compile per build key (roles/llama_cpp/keys.py): the key, the builder, and the copy.

The copy's scripts run for real here: pack.sh packs a fake build, a local HTTP server stands in
for the builder's md-share, copy.sh fetches, verifies and unpacks it, and a corrupted tarball is
refused with one message while nothing is installed.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.model import Failover
from meshdeploy.core.context import HostContext
from meshdeploy.errors import ApplyError
from meshdeploy.roles.llama_cpp import copies, keys
from meshdeploy.roles.llama_cpp import operations as ops
from meshdeploy.roles.llama_cpp import settings

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
DEBIAN = {"kernel": "Linux", "machine": "x86_64", "distro": "debian", "version": "12",
          "tools": [], "termux": False}


def lab():
    """The lab's cluster without its file's GGML_NATIVE: the CPU code is meshdeploy's to choose."""
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    return settings.with_build(cluster, cmake_flags=())


def host_facts(machine="x86_64", libc="glibc 2.36", builds=None, current=None):
    return {"toolchain.Platform": {**DEBIAN, "machine": machine}, "llama_cpp.Libc": libc,
            "llama_cpp.Builds": {"current": current, "builds": builds or {}}}


def contexts(cluster, facts, replace_=(), failed=()):
    resolved = run_values(commit=COMMIT, build_number=11312, replace=tuple(replace_))
    return {h.name: HostContext(cluster, h, facts[h.name], resolved, cluster_facts=facts,
                                failed_hosts=frozenset(failed))
            for h in cluster.hosts}


def decisions(cluster, facts, **kw):
    return {name: keys.decide(ctx) for name, ctx in contexts(cluster, facts, **kw).items()}


def same_platform(cluster, **overrides):
    return {h.name: overrides.get(h.name, host_facts()) for h in cluster.hosts}


# -- the key ---------------------------------------------------------------------------------------

def test_hosts_of_one_platform_share_one_portable_key_whatever_their_targets():
    cluster = lab()
    got = decisions(cluster, same_platform(cluster))
    assert len({d.key for d in got.values()}) == 1  # node1 runs llama-server, node2/3 rpc
    assert all(d.builder == "node1" for d in got.values())
    assert got["node1"].targets == ("llama-server", "rpc")  # the union, built once
    assert got["node2"].targets == ("rpc",)
    assert got["node1"].portable
    assert "-DGGML_NATIVE=OFF" in ops.build_script(contexts(cluster, same_platform(cluster))[
        "node1"], got["node1"].key)


def test_another_cpu_architecture_or_c_library_makes_another_key_and_keeps_native_flags():
    cluster = lab()
    facts = same_platform(cluster, node2=host_facts(machine="aarch64"),
                          node3=host_facts(libc="glibc 2.31"))
    got = decisions(cluster, facts)
    assert len({d.key for d in got.values()}) == 3
    assert all(d.builder == name and not d.portable for name, d in got.items())
    # A host alone with its key keeps the flags and key it had before keys were shared.
    alone = contexts(cluster, facts)["node2"]
    assert "GGML_NATIVE" not in ops.build_script(alone, got["node2"].key)
    assert keys.cmake_flags(cluster, cluster.host("node2")) == keys.cmake_flags(
        cluster, cluster.host("node2"), portable=False)


def test_an_unknown_platform_shares_nothing():
    cluster = lab()
    facts = same_platform(cluster, node3=host_facts(libc=None))
    got = decisions(cluster, facts)
    assert got["node3"].builder == "node3" and got["node3"].members == ("node3",)
    assert got["node2"].members == ("node1", "node2")


def test_the_files_ggml_native_wins_over_the_portable_default():
    cluster = lab()
    cluster = settings.with_build(cluster, cmake_flags=("-DGGML_NATIVE=ON",))
    flags = keys.cmake_flags(cluster, cluster.host("node1"), portable=True)
    assert "-DGGML_NATIVE=OFF" not in flags and flags[-1] == "-DGGML_NATIVE=ON"


def test_without_the_other_hosts_facts_a_host_keeps_the_key_it_runs():
    cluster = lab()
    host = cluster.host("node2")
    portable = keys.build_key(cluster, host, COMMIT, False, keys.platform(host_facts()), True,
                              host_facts())
    facts = host_facts(current=portable)
    ctx = HostContext(cluster, host, facts, run_values(commit=COMMIT))  # no cluster_facts
    assert keys.decide(ctx).key == portable
    ctx.facts["llama_cpp.Builds"]["current"] = None
    assert keys.decide(ctx).key != portable


# -- the builder -----------------------------------------------------------------------------------

def manifest(targets="llama-server ggml-rpc-server"):
    return {"commit": COMMIT, "rpc_binary": "ggml-rpc-server", "targets": targets}


def parallel(cluster):
    """The lab builds one host at a time (build.serial); most clusters do not."""
    return settings.with_build(cluster, serial=False)


def test_a_host_that_has_the_build_installed_serves_it_instead_of_a_compile():
    cluster = parallel(lab())
    key = decisions(cluster, same_platform(cluster))["node1"].key
    facts = same_platform(cluster, node3=host_facts(builds={key: manifest()}, current=key))
    got = decisions(cluster, facts)
    assert got["node1"].builder == "node3" and "installed" in got["node1"].why
    # One that lacks a binary the key's hosts need (node1's llama-server) is no builder.
    facts["node3"]["llama_cpp.Builds"]["builds"][key] = manifest(" ggml-rpc-server")
    assert decisions(cluster, facts)["node1"].builder == "node1"


def test_serial_builds_keep_the_first_host_as_builder():
    cluster = lab()
    assert settings.of(cluster).build.serial
    key = decisions(cluster, same_platform(cluster))["node1"].key
    facts = same_platform(cluster, node3=host_facts(builds={key: manifest()}, current=key))
    assert decisions(cluster, facts)["node2"].builder == "node1"


def test_replace_compiles_on_the_named_host():
    cluster = lab()
    got = decisions(cluster, same_platform(cluster), replace_=("node2/llama_cpp.build",))
    assert got["node1"].builder == "node2" and got["node3"].builder == "node2"
    got = decisions(cluster, same_platform(cluster),
                    replace_=("node2/llama_cpp.build", "node3/llama_cpp.build"))
    assert got["node3"].builder == "node3" and got["node3"].members == ("node3",)
    assert got["node1"].builder == "node2"
    ctx = contexts(cluster, same_platform(cluster), replace_=("node3/llama_cpp.build",))["node3"]
    step = ops.build(ctx)
    assert step.change.action == "replace" and "FORCE=1" in step.commands[0]


def test_forwards_keep_every_host_compiling():
    cluster = lab()
    other = replace(cluster, network=replace(cluster.network, transport="ssh"))
    got = decisions(other, same_platform(other))
    assert all(d.builder == name and not d.portable for name, d in got.items())


def wireguard(cluster):
    return replace(cluster, network=replace(cluster.network, transport="wireguard"))


def two_meshes(tmp_path) -> Path:
    """node1 serves a model alone; node2 serves gemma with node3's rpc-server: node1 is no
    tunnel peer of the others."""
    text = (ROOT / "inventories" / "lab.yaml").read_text()
    text = text.replace("  main:\n    host: node1\n", "  main:\n    host: node2\n"
                        "    rpc: [node3:50052]\n", 1)
    text = text.replace("\nservers:\n", "\nservers:\n  alone:\n    host: node1\n    model: other\n"
                        "    port: 8081\n    rpc: none\n", 1)
    text = text.replace("\nmodels:\n", "\nmodels:\n  other:\n    huggingface:\n"
                        "      repo: hugginllam/other-GGUF\n      file: other.gguf\n", 1)
    text = text.replace("    rpc_servers:\n      - port: 50052\n", "", 1)  # node2's
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    return path


def test_through_a_tunnel_peers_copy_from_the_first_host_of_their_star():
    """Under WireGuard a copy goes through the tunnel: the lab's workers are the orchestrator's
    peers and copy its build."""
    cluster = wireguard(lab())
    got = decisions(cluster, same_platform(cluster))
    assert {n: d.builder for n, d in got.items()} == {"node1": "node1", "node2": "node1",
                                                      "node3": "node1"}
    assert got["node1"].copiers() == ["node2", "node3"] and got["node1"].portable
    assert "tunnel peers copy it" in got["node1"].why


def test_a_host_no_tunnel_reaches_compiles_for_itself(tmp_path):
    plain = load_cluster(two_meshes(tmp_path))
    got = decisions(plain, same_platform(plain))
    assert {n: d.builder for n, d in got.items()} == {"node1": "node1", "node2": "node1",
                                                      "node3": "node1"}
    cluster = wireguard(plain)
    assert [p.name for p in cluster.tunnel_peers(cluster.host("node1"))] == []
    got = decisions(cluster, same_platform(cluster))
    assert {n: d.builder for n, d in got.items()} == {"node1": "node1", "node2": "node2",
                                                      "node3": "node2"}
    assert got["node1"].members == ("node1",) and got["node2"].copiers() == ["node3"]
    copiers = keys.copiers(cluster, cluster.hosts, same_platform(cluster), COMMIT)
    assert copiers == {"node2": ("node3",)}


def test_through_a_tunnel_only_the_first_host_of_a_star_builds_for_others():
    """-replace of a worker makes it compile alone (its peers may not reach it); of the first
    host, that host compiles for its star; a worker holding the build does not become the
    builder (the others may not be its peers)."""
    cluster = wireguard(lab())
    got = decisions(cluster, same_platform(cluster), replace_=("node2/llama_cpp.build",))
    assert got["node2"].builder == "node2" and got["node2"].members == ("node2",)
    assert got["node3"].builder == "node1" and got["node1"].copiers() == ["node3"]
    got = decisions(cluster, same_platform(cluster), replace_=("node1/llama_cpp.build",))
    assert got["node3"].builder == "node1" and got["node1"].why == "-replace builds it there"
    cluster = parallel(cluster)  # the lab builds one host at a time: no installed builder
    key = got["node1"].key
    facts = same_platform(cluster, node3=host_facts(builds={key: manifest()}, current=key))
    got = decisions(cluster, facts)
    assert got["node2"].builder == "node1" and got["node3"].builder == "node1"
    plain = decisions(parallel(lab()), facts)  # without the tunnel node3 serves what it holds
    assert plain["node2"].builder == "node3" and "installed" in plain["node3"].why



def test_copy_false_in_the_file_keeps_every_host_compiling(tmp_path):
    text = (ROOT / "inventories" / "lab.yaml").read_text()
    assert "    serial: true" in text
    path = tmp_path / "lab.yaml"
    path.write_text(text.replace("    serial: true", "    copy: false\n    serial: true", 1))
    cluster = load_cluster(path)
    assert settings.of(cluster).build.copy is False and settings.of(lab()).build.copy is True
    got = decisions(cluster, same_platform(cluster))
    assert all(d.builder == name and not d.portable for name, d in got.items())
    assert keys.copiers(cluster, cluster.hosts, same_platform(cluster), COMMIT) == {}

# -- never a build up a privilege boundary --------------------------------------------------------

def node1_rootless(tmp_path, extra: str = "") -> Path:
    """The lab's file with node1 (the orchestrator, first in file order) rootless: it validates
    (its llama-server binds loopback, so the firewall needs no acknowledgement)."""
    text = (ROOT / "inventories" / "lab.yaml").read_text()
    node1 = ("  node1:\n    address: 10.200.0.11\n"
             "    ssh: {user: deploy, config: /var/lib/meshdeploy/lab/mdlab/ssh_config, sudo: true}\n"
             "    backend: cpu\n")
    assert node1 in text
    text = text.replace(node1, "  node1:\n    address: 10.200.0.11\n"
                        "    ssh: {user: md, config: /var/lib/meshdeploy/lab/mdlab/ssh_config}\n"
                        "    backend: cpu\n    rootless: true\n", 1)
    text = text.replace("network:\n  rpc_bind: address\n",
                        f"network:\n  rpc_bind: address\n  firewall: true\n{extra}", 1)
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    return path


def upward(cluster, got) -> list[str]:
    """'copier <- builder' for every host with root whose build a rootless host makes."""
    return [f"{name} <- {d.builder}" for name, d in got.items()
            if not cluster.host(name).rootless and cluster.host(d.builder).rootless]


def test_a_rootless_host_never_builds_for_hosts_with_root(tmp_path):
    """The lab's file with node1 rootless: node1 no longer compiles for node2 and node3 (it
    did as the first host in file order), neither as the first host, nor with the build
    installed (a planted manifest), nor under a tunnel; a -replace of node1 makes it compile
    for itself alone. It still copies the build of a host with root, which may flow down."""
    cluster = load_cluster(node1_rootless(tmp_path))
    assert cluster.host("node1").rootless and not cluster.host("node2").rootless
    facts = same_platform(cluster)
    got = decisions(cluster, facts)
    assert upward(cluster, got) == []
    assert {n: d.builder for n, d in got.items()} == {"node1": "node2", "node2": "node2",
                                                      "node3": "node2"}
    assert got["node2"].why == "the first host of the key in file order with root"
    assert keys.copiers(cluster, cluster.hosts, facts, COMMIT) == {"node2": ("node1", "node3")}
    ctxs = contexts(cluster, facts)
    assert ops.source(ctxs["node3"]).change.reason == "copies its build from node2: no clone needed"
    assert "node2 compiles" in ops.build(ctxs["node1"]).change.reason
    # The plan (without the commit) and apply's decision once it resolves the ref agree.
    assert keys.copiers(cluster, cluster.hosts, facts, None) == {"node2": ("node1", "node3")}
    # A manifest of the key on node1 (written by node1's user: planted, as far as root knows).
    key = got["node2"].key
    planted = same_platform(cluster, node1=host_facts(
        builds={key: {**manifest(), "archive": f"{'a' * 64} 4096"}}, current=key))
    got = decisions(parallel(cluster), planted)
    assert upward(cluster, got) == [] and got["node3"].builder == "node2"
    assert got["node3"].why == "the first host of the key in file order with root"
    # node2 holding it is the builder as before.
    held = same_platform(cluster, node2=host_facts(builds={key: manifest()}, current=key))
    assert decisions(parallel(cluster), held)["node3"].why == "it has that build installed"
    # -replace of node1: it compiles for itself; node2 for node3.
    got = decisions(cluster, facts, replace_=("node1/llama_cpp.build",))
    assert got["node1"].builder == "node1" and got["node1"].members == ("node1",)
    assert got["node3"].builder == "node2" and got["node2"].copiers() == ["node3"]
    got = decisions(cluster, facts, replace_=("node1/llama_cpp.build", "node3/llama_cpp.build"))
    assert got["node2"].builder == "node3" and got["node1"].builder == "node1"
    # Under a tunnel the stars start from the hosts with root: node3 (node1's peer alone) has no
    # star it may copy from and compiles; node1 copies from node2.
    got = decisions(wireguard(cluster), same_platform(cluster))
    assert upward(cluster, got) == []
    assert {n: d.builder for n, d in got.items()} == {"node1": "node2", "node2": "node2",
                                                      "node3": "node3"}


def test_md_shares_port_opens_on_no_rootless_host_for_hosts_with_root(tmp_path):
    from meshdeploy.roles.network import rules

    cluster = load_cluster(node1_rootless(tmp_path))
    copiers = keys.copiers(cluster, cluster.hosts, same_platform(cluster), COMMIT)
    assert rules.allowlist(cluster, cluster.host("node2"), copiers["node2"])["29180"] == [
        "lo", "10.200.0.11", "10.200.0.13"]
    assert "node1" not in copiers


def test_rootless_hosts_alone_still_share_a_build(tmp_path):
    cluster = load_cluster(node1_rootless(tmp_path))
    hosts = tuple(replace(h, rootless=True) for h in cluster.hosts)
    cluster = replace(cluster, hosts=hosts)
    got = decisions(cluster, same_platform(cluster))
    assert {d.builder for d in got.values()} == {"node1"}
    assert got["node1"].why == "the first host of the key in file order"


def test_a_copy_from_a_builder_whose_build_failed_stops_with_one_message():
    cluster = lab()
    ctx = contexts(cluster, same_platform(cluster), failed=("node1",))["node2"]
    with pytest.raises(ApplyError, match="nothing to copy: the build of .* on node1 failed"):
        copies.copy(ctx)


# -- pack.sh and copy.sh, run for real -------------------------------------------------------------

def fake_build(folder: Path, key: str) -> None:
    (folder / "bin").mkdir(parents=True)
    server = folder / "bin" / "llama-server"
    server.write_text("#!/bin/sh\necho 'version: 1 (0c1e570)'\n")
    rpc = folder / "bin" / "ggml-rpc-server"
    rpc.write_text("#!/bin/sh\necho usage\n")
    for f in (server, rpc):
        f.chmod(0o755)
    (folder / "manifest").write_text(manifest_text(key))


def manifest_text(key: str) -> str:
    return (f"commit={COMMIT}\nbackend=cpu\nkey={key}\nrpc_binary=ggml-rpc-server\n"
            "targets=llama-server ggml-rpc-server\nproto=7.0.0\n")


@pytest.fixture
def served(tmp_path):
    """A folder served over HTTP as md-share serves files: GET /models/NAME."""
    root = tmp_path / "srv"
    (root / "models").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root / "models", f"http://127.0.0.1:{server.server_address[1]}/models"
    server.shutdown()


def run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)


@pytest.fixture
def open_dir():
    """A folder every user may enter (pytest's own are 0700): where a copy runs its binaries
    as nobody."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="md-copy-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def copy_script(url: str, out: Path, key: str, expect: str = "", size: int = 1 << 20) -> str:
    from meshdeploy.core import progress, shell
    return shell.template(ops.TEMPLATES / "copy.sh", prelude=progress.SHELL + "\n" + shell.SHA256,
                          URL=f"{url}/{key}.tar.gz", SUMURL=f"{url}/{key}.tar.gz.sha256",
                          EXPECT=expect, SIZE=size, OUT=str(out), KEY=key, COMMIT=COMMIT,
                          BUILDER="node1",
                          HOST="node2", WAIT=4, ARCHIVE=f"/opt/meshdeploy/build/share/{key}.tar.gz")


def pack(build: Path, archive: Path) -> subprocess.CompletedProcess:
    from meshdeploy.core import shell
    return run(shell.template(ops.TEMPLATES / "pack.sh", prelude=shell.SHA256, BUILD=str(build),
                              ARCHIVE=str(archive)))


def test_a_packed_build_is_copied_verified_and_its_binaries_run(tmp_path, served, open_dir):
    folder, url = served
    key = "0c1e57098bba-cpu-1aca21d4"
    fake_build(tmp_path / "b1" / key, key)
    done = pack(tmp_path / "b1" / key, folder / f"{key}.tar.gz")
    assert done.returncode == 0, done.stderr
    digest = hashlib.sha256((folder / f"{key}.tar.gz").read_bytes()).hexdigest()
    assert (folder / f"{key}.tar.gz.sha256").read_text().strip() == digest
    out = open_dir / "b2" / "builds" / key
    size = (folder / f"{key}.tar.gz").stat().st_size
    done = run(copy_script(url, out, key, expect=digest, size=size))
    assert done.returncode == 0, done.stderr
    assert (out / "manifest").read_text().startswith(f"commit={COMMIT}")
    assert os.access(out / "bin" / "llama-server", os.X_OK)
    assert not list(out.parent.glob("*.tmp"))
    # Packing again keeps the archive (and its sha256) the copies are checked against.
    before = (folder / f"{key}.tar.gz").stat().st_mtime_ns
    assert pack(tmp_path / "b1" / key, folder / f"{key}.tar.gz").returncode == 0
    assert (folder / f"{key}.tar.gz").stat().st_mtime_ns == before


def builds_fact(tmp_path: Path, archives: Path) -> dict:
    from meshdeploy.roles.llama_cpp.facts import Builds

    fact = Builds()
    done = run(fact.command(str(tmp_path / "b1"), str(tmp_path / "current"), str(archives)))
    return fact.process(done.stdout.splitlines())["builds"]


def test_pack_keeps_an_archive_made_in_the_manifests_tick_and_repacks_an_older_one(tmp_path):
    """A file's time has the kernel's tick as its grain: a tiny build is packed within the tick
    its manifest was written in, so 'archive newer than manifest' failed and packing again
    replaced the archive the copies were checked against. Equal times keep it; a manifest
    written after the archive (the build installed again) packs anew."""
    key = "0c1e57098bba-cpu-1aca21d4"
    build, tarball = tmp_path / "b1" / key, tmp_path / "share" / f"{key}.tar.gz"
    fake_build(build, key)
    assert pack(build, tarball).returncode == 0
    stamp = tarball.stat().st_mtime_ns
    os.utime(build / "manifest", ns=(stamp, stamp))
    assert pack(build, tarball).stdout == ""  # kept
    assert tarball.stat().st_mtime_ns == stamp
    os.utime(build / "manifest", ns=(stamp + 1_000_000, stamp + 1_000_000))
    assert pack(build, tarball).stdout.startswith("packed ")
    assert (tarball.parent / f"{key}.tar.gz.sha256").read_text().strip() == hashlib.sha256(
        tarball.read_bytes()).hexdigest()


def test_a_tarball_changed_after_its_sha256_is_packed_again(tmp_path, served):
    """The Builds fact reports no tarball where it is newer than its sha256 (so the builder's
    llama_cpp.build packs it again, before anything is copied), and pack.sh packs it again."""
    folder, _ = served
    key = "0c1e57098bba-cpu-1aca21d4"
    fake_build(tmp_path / "b1" / key, key)
    tarball = folder / f"{key}.tar.gz"
    assert pack(tmp_path / "b1" / key, tarball).returncode == 0
    computed = (folder / f"{key}.tar.gz.sha256").read_text().strip()
    assert builds_fact(tmp_path, folder)[key]["archive"] == f"{computed} {tarball.stat().st_size}"
    good = tarball.read_bytes()
    tarball.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    stamp = (folder / f"{key}.tar.gz.sha256").stat().st_mtime_ns + 1_000_000
    os.utime(tarball, ns=(stamp, stamp))  # written after its sha256
    assert "archive" not in builds_fact(tmp_path, folder)[key]
    assert pack(tmp_path / "b1" / key, tarball).returncode == 0
    again = (folder / f"{key}.tar.gz.sha256").read_text().strip()
    assert hashlib.sha256(tarball.read_bytes()).hexdigest() == again
    assert builds_fact(tmp_path, folder)[key]["archive"].split()[0] == again
    tarball.unlink()  # removed by hand: none, and packed again
    assert "archive" not in builds_fact(tmp_path, folder)[key]
    assert pack(tmp_path / "b1" / key, tarball).returncode == 0 and tarball.exists()


def test_a_corrupted_archive_is_refused_and_nothing_is_installed(tmp_path, served):
    folder, url = served
    key = "0c1e57098bba-cpu-1aca21d4"
    fake_build(tmp_path / "b1" / key, key)
    assert pack(tmp_path / "b1" / key, folder / f"{key}.tar.gz").returncode == 0
    tarball = folder / f"{key}.tar.gz"
    computed = (folder / f"{key}.tar.gz.sha256").read_text().strip()
    data = bytearray(tarball.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tarball.write_bytes(bytes(data))
    out = tmp_path / "b2" / "builds" / key
    done = run(copy_script(url, out, key, expect=computed))
    assert done.returncode == 1
    assert f"node2: refused the copy of build {key} from node1: its sha256 is" in done.stderr
    assert "current is unchanged" in done.stderr
    assert (f"hint: if node1's tarball is damaged, remove /opt/meshdeploy/build/share/{key}"
            ".tar.gz there: the next apply packs it again") in done.stderr
    assert not out.exists() and not list(out.parent.iterdir())


def test_a_copy_that_cannot_be_unpacked_leaves_nothing_behind(tmp_path, served):
    """A gzip whose content is no tar (sha256 as computed: the builder packed it so) passes the
    listing checks, which read nothing, and fails to unpack: one message, and neither the
    unpacked tar nor a half build stays under builds/ (activate.sh's pruning would count an
    unpacked tar not named .tmp as a build)."""
    import gzip
    import hashlib
    folder, url = served
    key = "0c1e57098bba-cpu-1aca21d4"
    data = gzip.compress(b"not a tar archive, " * 100)
    (folder / f"{key}.tar.gz").write_bytes(data)
    computed = hashlib.sha256(data).hexdigest()
    (folder / f"{key}.tar.gz.sha256").write_text(computed + "\n")
    out = tmp_path / "b2" / "builds" / key
    done = run(copy_script(url, out, key, expect=computed))
    assert done.returncode == 1
    assert f"node2: could not unpack build {key} into {out}.tmp" in done.stderr
    assert not list(out.parent.iterdir())


def hand_packed(folder: Path, key: str, extra=(), server="echo 'version: 1 (0c1e570)'",
                rpc="echo usage") -> tuple[str, int]:
    """A build's tarball made by hand (any mode, any owner), its sha256 beside it as pack.sh
    writes it; `extra`: (name, bytes or None for a folder, mode, uid). (sha256, bytes)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        def add(name, data, mode, uid=0):
            info = tarfile.TarInfo(name)
            info.mode, info.uid, info.gid = mode, uid, uid
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        add("./bin", None, 0o755)
        add("./manifest", manifest_text(key).encode(), 0o644)
        add("./bin/llama-server", f"#!/bin/sh\n{server}\n".encode(), 0o755)
        add("./bin/ggml-rpc-server", f"#!/bin/sh\n{rpc}\n".encode(), 0o755)
        for entry in extra:
            add(*entry)
    data = buf.getvalue()
    (folder / f"{key}.tar.gz").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    (folder / f"{key}.tar.gz.sha256").write_text(digest + "\n")
    return digest, len(data)


def test_the_copied_binaries_run_first_as_nobody_where_the_copy_runs_as_root(served, open_dir):
    """What a copy runs before anything trusts the build (llama-server --version, the RPC
    worker's --help) runs as nobody where copy.sh runs as root; elsewhere (a rootless host) as
    the user copy.sh runs as."""
    import pwd

    folder, url = served
    key = "0c1e57098bba-cpu-1aca21d4"
    seen = open_dir / "seen"
    seen.mkdir()
    seen.chmod(0o777)
    digest, size = hand_packed(folder, key,
                               server=f"id -u > {seen}/server; echo 'version: 1 (0c1e570)'",
                               rpc=f"id -u > {seen}/rpc; echo usage")
    out = open_dir / "builds" / key
    done = run(copy_script(url, out, key, expect=digest, size=size))
    assert done.returncode == 0, done.stderr
    want = pwd.getpwnam("nobody").pw_uid if os.geteuid() == 0 else os.geteuid()
    assert (seen / "server").read_text().split() == [str(want)]
    assert (seen / "rpc").read_text().split() == [str(want)]


def test_a_setuid_entry_unpacks_without_special_bits_owned_by_the_copier(served, open_dir):
    """Root's tar keeps an entry's mode, setuid included: a 4755 file unpacked as root was
    setuid-root. The copy unpacks every entry as its own user's, its mode under umask 022."""
    import tarfile

    folder, url = served
    key = "0c1e57098bba-cpu-1aca21d4"
    digest, size = hand_packed(folder, key, extra=[
        ("./bin/llama-suid", b"#!/bin/sh\n", 0o4755, 0),
        ("./bin/llama-sgid", b"#!/bin/sh\n", 0o2755, 1234),
        ("./share", None, 0o1777, 1234)])
    with tarfile.open(folder / f"{key}.tar.gz") as tar:
        before = {m.name: m.mode for m in tar.getmembers()}
    assert (before["./bin/llama-suid"], before["./bin/llama-sgid"], before["./share"]) == (
        0o4755, 0o2755, 0o1777)
    out = open_dir / "builds" / key
    done = run(copy_script(url, out, key, expect=digest, size=size))
    assert done.returncode == 0, done.stderr
    after = {name: (out / name).stat() for name in ("bin/llama-suid", "bin/llama-sgid", "share",
                                                    "bin/llama-server")}
    assert {n: oct(st.st_mode & 0o7777) for n, st in after.items()} == {
        "bin/llama-suid": "0o755", "bin/llama-sgid": "0o755", "share": "0o755",
        "bin/llama-server": "0o755"}
    assert {st.st_uid for st in after.values()} == {os.geteuid()}


class Endless(http.server.BaseHTTPRequestHandler):
    """A body without Content-Length that ends only when the client stops reading (or at
    server.limit bytes): server.sent counts what the socket took."""

    protocol_version = "HTTP/1.0"

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        chunk = b"0" * 65536
        try:
            while self.server.sent < self.server.limit:
                self.wfile.write(chunk)
                self.server.sent += len(chunk)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def endless():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    server.sent, server.limit = 0, 512 << 20
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}/models"
    server.shutdown()


def test_a_tarball_longer_than_its_builder_packed_is_refused_unread(tmp_path, served, endless):
    """copy.sh reads at most the bytes the builder reported (SIZE, read back with its sha256)
    plus one, whether the server says a longer Content-Length or none."""
    folder, url = served
    key = "0c1e57098bba-cpu-1aca21d4"
    digest, size = hand_packed(folder, key)
    out = tmp_path / "builds" / key
    done = run(copy_script(url, out, key, expect=digest, size=size - 1))
    assert done.returncode == 1
    assert done.stderr.endswith(f"node2: node1 serves more than the {size - 1} bytes of build "
                                f"{key} it packed; current is unchanged\n"), done.stderr
    assert not list(out.parent.iterdir())
    server, url = endless  # the sha256 from the first server, the tarball endless
    script = copy_script(url, out, key, expect=digest, size=4096).replace(
        f"SUMURL={url}/{key}.tar.gz.sha256", f"SUMURL={served[1]}/{key}.tar.gz.sha256")
    assert f"SUMURL={served[1]}/" in script
    done = run(script)
    assert done.returncode == 1
    assert "node1 serves more than the 4096 bytes" in done.stderr, done.stderr
    assert server.sent < 64 << 20, server.sent
    assert not list(out.parent.iterdir())


def test_a_sha256_without_end_is_refused_at_once(tmp_path, endless):
    server, url = endless
    started = time.monotonic()
    done = run(copy_script(url, tmp_path / "builds" / "k", "k", expect="a" * 64))
    assert done.returncode == 1
    assert done.stderr == "node2: node1 serves more than a sha256 for build k; current is unchanged\n"
    assert server.sent < 64 << 20 and time.monotonic() - started < 4


def test_a_builder_that_never_serves_ends_the_wait_with_one_message(tmp_path, served):
    _, url = served
    out = tmp_path / "builds" / "k"
    done = run(copy_script(url, out, "k"))
    assert done.returncode == 1
    assert "node1 did not serve build k within 4 s" in done.stderr


def test_a_fetch_that_keeps_failing_is_tried_four_times_then_named(tmp_path, served):
    folder, url = served
    key = "k"
    (folder / f"{key}.tar.gz.sha256").write_text("a" * 64 + "\n")  # and no tarball: 404
    started = time.monotonic()
    done = run(copy_script(url, tmp_path / "builds" / key, key, expect="a" * 64))
    assert done.returncode == 1
    assert done.stderr.count("404") == 4, done.stderr
    assert done.stderr.endswith(f"node2: could not fetch build {key} from node1; current is "
                                "unchanged\n")
    assert time.monotonic() - started >= 6  # 2 s between tries


def test_md_shares_port_opens_on_the_builder_to_its_copiers_alone():
    from meshdeploy.roles.network import rules

    cluster = lab()
    facts = same_platform(cluster)
    copiers = keys.copiers(cluster, cluster.hosts, facts, COMMIT)
    assert copiers == {"node1": ("node2", "node3")}
    assert rules.allowlist(cluster, cluster.host("node1"), copiers["node1"])["29180"] == [
        "lo", "10.200.0.12/31"]  # node2 and node3, merged
    assert "29180" not in rules.allowlist(cluster, cluster.host("node2"))
    # -replace makes another host the builder: its port opens, to the others.
    assert keys.copiers(cluster, cluster.hosts, facts, COMMIT, ("node2/llama_cpp.build",)) == {
        "node2": ("node1", "node3")}


def test_a_copier_left_out_by_limit_keeps_its_place_at_the_builders_md_share():
    """apply --limit node1,node2 with node3 away: who copies node1's build is decided from the
    probed hosts (node2), so node1's md-share port would close for node3, and a later
    `apply --limit node3` would find it shut. A host outside the run that the loaded table
    admits keeps its place; one it does not admit is not let in by a run that cannot tell."""
    from meshdeploy.roles.network import operations as network
    from meshdeploy.roles.network import rules

    cluster = lab()
    facts = same_platform(cluster)
    both = rules.allowlist(cluster, cluster.host("node1"), ("node2", "node3"))
    assert both["29180"] == ["lo", "10.200.0.12/31"]  # node2 and node3, merged by nft
    in_run = keys.copiers(cluster, [cluster.host("node1"), cluster.host("node2")],
                          {h: facts[h] for h in ("node1", "node2")}, COMMIT)
    assert in_run == {"node1": ("node2",)}

    def step(live):
        node1 = {**facts["node1"], "network.Tools": ["nft"], "network.Allowlist": live}
        ctx = HostContext(cluster, cluster.host("node1"), node1,
                          run_values(commit=COMMIT, build_copiers=in_run),
                          cluster_facts={"node1": node1, "node2": facts["node2"]})
        return network.allowlist(ctx)

    kept = step(both)
    assert kept.change.action == "no-op", kept.change.diffs
    alone = rules.allowlist(cluster, cluster.host("node1"), ("node2",))
    assert step(alone).change.action == "no-op"  # node3 is not let in either
    # In a run with every host, node3 is a copier again (the table it had).
    full = network.allowlist(HostContext(
        cluster, cluster.host("node1"), {**facts["node1"], "network.Tools": ["nft"],
                                         "network.Allowlist": alone},
        run_values(commit=COMMIT, build_copiers=keys.copiers(cluster, cluster.hosts, facts,
                                                             COMMIT)),
        cluster_facts=facts))
    assert full.change.action == "update" and "10.200.0.12/31" in "\n".join(full.commands)


def test_fresh_hosts_plan_the_allow_list_that_apply_converges_to(tmp_path):
    """Hosts with nothing installed: no git, so the plan cannot resolve the ref (no lock file
    either) and the commit is unknown. Who copies from whom is the same as once the hosts are
    converged (builds installed, the ref locked): the plan after apply opens nothing new."""
    from meshdeploy.core import registry
    from meshdeploy.roles.llama_cpp import lock
    from meshdeploy.roles.llama_cpp.role import ROLE

    path = tmp_path / "lab.yaml"
    path.write_text((ROOT / "inventories" / "lab.yaml").read_text())
    cluster = load_cluster(path)

    def copiers(facts):
        prepared = ROLE.prepare(registry.Prepare(cluster, cluster.hosts, facts, run_values()))
        return prepared.values.commit, prepared.values.build_copiers

    fresh = same_platform(cluster)
    fresh["node1"]["llama_cpp.RemoteRef"] = None  # `nogit`
    assert copiers(fresh) == (None, {"node1": ("node2", "node3")})
    key = decisions(cluster, fresh)["node1"].key
    lock.write_lock(path, settings.of(cluster).repo, settings.of(cluster).ref, COMMIT)
    converged = same_platform(cluster, **{h: host_facts(builds={key: manifest()}, current=key)
                                          for h in ("node1", "node2", "node3")})
    converged["node1"]["llama_cpp.RemoteRef"] = COMMIT
    assert copiers(converged) == (COMMIT, {"node1": ("node2", "node3")})


def test_apply_decides_the_copiers_again_once_it_resolves_the_ref(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text((ROOT / "inventories" / "lab.yaml").read_text())
    cluster = load_cluster(path)
    facts = same_platform(cluster)
    ctx = HostContext(cluster, cluster.host("node1"), facts["node1"], run_values(), first=True,
                      run_command=lambda command: (True, [f"{COMMIT}\trefs/tags/b11312"]),
                      cluster_facts=facts)
    step = ops.resolve(ctx)
    assert (step.resolves.commit, step.resolves.build_copiers) == (
        COMMIT, {"node1": ("node2", "node3")})
    assert step.change.role == "llama_cpp"  # apply keeps them as the llama_cpp role's


def test_a_builder_without_python3_gets_it_for_md_share():
    from meshdeploy.roles.toolchain import operations as toolchain

    cluster = lab()
    # Without failover: md-failover (Python too) would want python3 on node1 either way.
    cluster = replace(cluster, servers=tuple(
        replace(s, failover=Failover(tolerate=0)) for s in cluster.servers))
    facts = same_platform(cluster)
    copiers = keys.copiers(cluster, cluster.hosts, facts, COMMIT)
    installed = {p: True for p in toolchain.wanted_packages(cluster, "apt", cluster.host("node1"))}
    for tools, wanted in ((["apt-get", "python3"], False), (["apt-get"], True)):
        node1 = {**facts["node1"], "toolchain.DebPackages": installed,
                 "toolchain.Platform": {**DEBIAN, "tools": tools}}
        ctx = HostContext(cluster, cluster.host("node1"), node1,
                          run_values(commit=COMMIT, build_copiers=copiers))
        step = toolchain.packages(ctx)
        assert ("python3" in "\n".join(step.commands)) is wanted, step.commands


def test_the_builder_serves_a_new_build_as_created_and_an_installed_one_as_updated():
    cluster = lab()
    fresh = same_platform(cluster)
    assert copies.copy(contexts(cluster, fresh)["node1"]).change.action == "create"
    key = decisions(cluster, fresh)["node1"].key
    built = same_platform(cluster, **{h: host_facts(builds={key: manifest()}, current=key)
                                      for h in ("node1", "node2")})
    step = copies.copy(contexts(cluster, built)["node1"])
    assert step.change.action == "update" and "to node3 " in step.change.reason


def test_apply_never_copies_without_the_sha256_the_builder_computed():
    cluster = lab()
    ctx = contexts(cluster, same_platform(cluster))["node2"]
    assert copies.copy(ctx).commands == []  # a plan: known after apply
    ctx.run_command = lambda command: (True, [])  # apply: node1's tarball must be known now
    with pytest.raises(ApplyError, match="node2: node1 has no tarball of build"):
        copies.copy(ctx)


def test_a_builder_packs_an_installed_build_once_copiers_appear():
    cluster = lab()
    key = decisions(cluster, same_platform(cluster))["node1"].key
    facts = same_platform(cluster, node1=host_facts(builds={key: manifest()}, current=key))
    step = ops.build(contexts(cluster, facts)["node1"])
    assert step.change.action == "update" and "pack" in step.change.reason
    assert len(step.commands) == 1 and "cmake" not in step.commands[0]
    facts["node1"]["llama_cpp.Builds"]["builds"][key]["archive"] = f"{'a' * 64} 10"
    assert ops.build(contexts(cluster, facts)["node1"]).noop


def test_a_tarball_served_with_another_sha256_than_computed_is_not_fetched(tmp_path, served):
    folder, url = served
    key = "0c1e57098bba-cpu-1aca21d4"
    fake_build(tmp_path / "b1" / key, key)
    assert pack(tmp_path / "b1" / key, folder / f"{key}.tar.gz").returncode == 0
    out = tmp_path / "b2" / "builds" / key
    done = run(copy_script(url, out, key, expect="b" * 64))
    assert done.returncode == 1
    assert f"node2: node1 serves build {key} with sha256" in done.stderr
    assert not out.exists()


def test_apply_reads_the_builders_new_sha256_back_before_a_copy():
    """execute.apply.Run: once node1's llama_cpp.build ran, node2's llama_cpp.copy re-reads
    node1's Builds fact (rereads_peers) and checks its copy against the sha256 found there."""
    from types import SimpleNamespace

    from meshdeploy.core import registry
    from meshdeploy.core.plan import Plan
    from meshdeploy.engine.planner import Planned
    from meshdeploy.execute.apply import Run

    cluster = lab()
    facts = same_platform(cluster)
    key = decisions(cluster, facts)["node1"].key
    packed = {"current": key, "builds": {key: {**manifest(), "key": key,
                                               "archive": f"{'c' * 64} 4096"}}}
    asked = []

    class Pyhost:
        def __init__(self, name):
            self.name = name

        def get_fact(self, fact, **kwargs):
            asked.append((self.name, fact.__name__))
            return packed

    session = SimpleNamespace(cluster=cluster, hosts=lambda: list(cluster.hosts), departed=(),
                              pyhosts={h.name: Pyhost(h.name) for h in cluster.hosts},
                              state=SimpleNamespace(failed_hosts=()))
    planned = Planned(Plan("lab", "lab.yaml", "c" * 64, {}, [], []),
                      run_values(commit=COMMIT, build_number=11312), facts, None)
    run = Run(session, planned, progress=None)
    build, copy = registry.resource("llama_cpp.build"), registry.resource("llama_cpp.copy")
    for h in ("node1", "node2", "node3"):
        run.step(h, build, None)
    step = run.step("node2", copy, None)
    assert asked == [("node1", "Builds")]  # node1 alone ran its build step
    assert f"EXPECT={'c' * 64}\n" in step.commands[0]
    assert run.step("node3", copy, None).commands and asked == [("node1", "Builds")]
