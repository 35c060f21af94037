"""One compile per build key, on real hosts (lab mdbc: three hosts of one platform, with nothing
installed: no toolchain, no git, so the first plan cannot resolve the ref).

The lab's hosts share one kernel, CPU, Debian release and glibc, so they share a build key:
node1 (first in file order; the lab builds serially) compiles once, and node2 and node3 copy
its build from node1's md-share. The lab file names GGML_NATIVE=OFF (inventories/lab.yaml: this
machine kind may advertise AMX it cannot run), and the plan says the file decides that. The first plan already says so and opens md-share's
port on node1 to node2 and node3, and the plan after apply says "No changes". Counted from the
hosts themselves: only node1 has a clone and a ninja log. Then node3 loses its build twice:
node1's tarball corrupted where its time stamp does not show it is refused with one message and
node3's `current` stays; once the tarball is removed, as the message says, the next apply packs
it again and the copy goes through, served by an md-share that was still running with the
corrupted file open. A tarball changed after its sha256 was written is packed again before any
copy. Last, node3 is rolled back to an older build by hand and apply switches it back with no
compile and no copy (activate.sh, the same path as a compile's). The base has no build tools,
so toolchain.packages installs them on node1 alone: node2 and node3, which copy, get curl and
libgomp1 (ca-certificates is in the base), and after apply have no cmake, compiler or ninja.
"""

from __future__ import annotations

import re
import time

import pytest
from conftest import own_lab
from support.cli import meshdeploy
from support.labfile import without_host, write_lab_file

pytestmark = [pytest.mark.lab, pytest.mark.build]

PREFIX = "/opt/meshdeploy"
NODES = ("node1", "node2", "node3")
NO_CHANGES = "No changes. The cluster matches the configuration."


@pytest.fixture(scope="module")
def bc_lab(lab_available, request):
    with own_lab(request, "mdbc", hosts=3, toolchain=False) as both:
        yield both


def sh(info, host: str, command: str) -> str:
    done = info.run(host, command, root=True)
    assert done.returncode == 0, f"{host}: {command}: {done.stderr}"
    return done.stdout.strip()


def seconds(output: str, host: str, step: str) -> float:
    match = re.search(rf"{host}\s+{re.escape(step)}\s+ok \(([0-9.]+) s\)", output)
    return float(match.group(1)) if match else -1.0


def host_lines(output: str, host: str) -> str:
    return "\n".join(line for line in output.splitlines() if line.strip().startswith(host))


@pytest.fixture(scope="module")
def applied(bc_lab, tmp_path_factory):
    info, _ = bc_lab
    path = write_lab_file(info, tmp_path_factory.mktemp("build-copy"))
    plan = meshdeploy("plan", path)
    assert plan.returncode == 0, plan.stderr
    started = time.monotonic()
    done = meshdeploy("apply", path, "--auto-approve")
    assert done.returncode == 0, done.stdout + done.stderr
    return info, path, plan.stdout, done.stdout, time.monotonic() - started


def tarball_of(info) -> tuple[str, str]:
    key = sh(info, "node1", f"readlink {PREFIX}/current").rsplit("/", 1)[-1]
    return key, f"{PREFIX}/build/share/{key}.tar.gz"


def flip_a_byte(info, tarball: str, keep_time: bool) -> None:
    """One byte flipped in the middle of node1's tarball, in place (the same file); with
    keep_time its time stamps are put back, as a disk error would leave them."""
    sh(info, "node1", "python3 -c \"import os, sys; p = sys.argv[1]; s = os.stat(p); "
                      "b = bytearray(open(p, 'rb').read()); b[len(b) // 2] ^= 255; "
                      "open(p, 'r+b').write(b); "
                      f"{'os.utime(p, ns=(s.st_atime_ns, s.st_mtime_ns))' if keep_time else ''}"
                      f"\" {tarball}")


def test_the_first_plan_on_bare_hosts_says_who_copies(applied):
    _, _, plan, _, _ = applied
    assert "ref not resolved yet" in plan  # no git on the hosts yet
    assert "node2/llama_cpp.copy will be created" in plan
    assert "node3/llama_cpp.copy will be created" in plan
    assert "node2/llama_cpp.build" not in plan and "node2/llama_cpp.source" not in plan
    assert "tcp/29180" in plan and "lo 10.200.0.12/31" in plan  # md-share on node1: node2, node3


def test_the_plan_after_apply_says_no_changes(applied):
    _, path, _, _, _ = applied
    again = meshdeploy("plan", path, "--detailed-exitcode")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip().endswith(NO_CHANGES), again.stdout


def test_node1_compiles_once_and_the_others_copy_its_build(applied):
    info, _, plan, output, took = applied
    current = {h: sh(info, h, f"readlink {PREFIX}/current") for h in NODES}
    assert len(set(current.values())) == 1, current
    key, tarball = tarball_of(info)
    archive = sh(info, "node1", f"wc -c < {tarball}")
    print(f"\nbuild-copy figures: archive {archive} bytes; node1 build "
          f"{seconds(output, 'node1', 'llama_cpp.build')} s; copies node2 "
          f"{seconds(output, 'node2', 'llama_cpp.copy')} s, node3 "
          f"{seconds(output, 'node3', 'llama_cpp.copy')} s; apply {took:.0f} s")
    # Compiles counted from the hosts: ninja's log and the clone exist on node1 alone.
    logs = {h: sh(info, h, f"ls {PREFIX}/build/*.build.log 2>/dev/null | wc -l") for h in NODES}
    assert logs == {"node1": "1", "node2": "0", "node3": "0"}, logs
    for h in ("node2", "node3"):
        assert sh(info, h, f"test -d {PREFIX}/src/llama.cpp && echo yes || echo no") == "no"
    binary = f"{PREFIX}/builds/{key}/bin/ggml-rpc-server"
    sums = {h: sh(info, h, f"sha256sum {binary} | cut -c1-64") for h in NODES}
    assert len(set(sums.values())) == 1, sums
    cache = sh(info, "node1", f"grep -h '^GGML_NATIVE:' {PREFIX}/build/cpu-*/CMakeCache.txt")
    assert cache == "GGML_NATIVE:BOOL=OFF"  # the lab file's: portable, no AMX
    assert "GGML_NATIVE as llama_cpp.build.cmake_flags sets it" in plan, plan
    # md-share's port on node1 opens to the copiers alone.
    table = sh(info, "node1", "nft list table inet meshdeploy")
    assert "29180" in table and "10.200.0.12/31" in table, table  # node2 and node3
    status = meshdeploy("status", applied[1])
    assert status.returncode == 0, status.stdout + status.stderr


def block(plan: str, address: str) -> str:
    """The plan's text of one resource: its comment lines and attributes."""
    match = re.search(rf"^  # {re.escape(address)} .*?^    }}$", plan, re.M | re.S)
    assert match, f"{address} not in the plan:\n{plan}"
    return match.group(0)


def test_only_the_builder_gets_the_compiler_toolchain(applied):
    info, _, plan, _, _ = applied
    assert "cmake g++ git curl ninja-build ccache" in block(plan, "node1/toolchain.packages")
    for h in ("node2", "node3"):
        said = block(plan, f"{h}/toolchain.packages")
        assert "# (install with apt; copies its llama.cpp build from node1: no compiler)" in said
        assert '+ packages = "curl libgomp1"' in said, said
        # Checked on the host: no build tool came with those, and the copied binaries ran.
        assert sh(info, h, "for t in cmake cc c++ ninja ccache git; do command -v $t; done; "
                           "true") == ""
        assert sh(info, h, "dpkg-query -W -f '${db:Status-Abbrev}\\n' curl libgomp1").split() \
            == ["ii", "ii"]
    assert sh(info, "node1", "command -v cmake c++ ninja git | wc -l") == "4"


def test_a_corrupted_tarball_is_refused_and_once_removed_packed_again_and_copied(applied):
    info, path, _, _, _ = applied
    key, tarball = tarball_of(info)
    sh(info, "node3", f"rm -rf {PREFIX}/builds/{key}")
    before = sh(info, "node3", f"readlink {PREFIX}/current")
    flip_a_byte(info, tarball, keep_time=True)  # node1 cannot tell: it serves it as is
    refused = meshdeploy("apply", path, "--auto-approve")
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert f"node3: refused the copy of build {key} from node1: its sha256 is" in said, said
    assert f"hint: if node1's tarball is damaged, remove {tarball} there" in said, said
    assert sh(info, "node3", f"readlink {PREFIX}/current") == before
    assert sh(info, "node3", f"ls -d {PREFIX}/builds/{key}* 2>/dev/null | wc -l") == "0"
    # The md-share that served the corrupted file ended with the failed run (it lives for one
    # run): the next one serves what is at the path then.
    assert info.run("node1", "systemctl is-active meshdeploy-share.service",
                    root=True).stdout.strip() \
        in ("inactive", "failed", "unknown"), "md-share outlived the run"
    sh(info, "node1", f"rm {tarball}")  # what the hint says
    again = meshdeploy("apply", path, "--auto-approve")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "llama_cpp.build" in host_lines(again.stdout, "node1")  # packed again
    assert "llama_cpp.copy" in host_lines(again.stdout, "node3")
    assert sh(info, "node3", f"readlink {PREFIX}/current").endswith(key)
    assert sh(info, "node1", f"sha256sum {tarball} | cut -c1-64") == sh(
        info, "node1", f"cut -c1-64 {tarball}.sha256")


def test_a_tarball_changed_after_its_sha256_is_packed_again_before_a_copy(applied):
    info, path, _, _, _ = applied
    key, tarball = tarball_of(info)
    sh(info, "node3", f"rm -rf {PREFIX}/builds/{key}")
    flip_a_byte(info, tarball, keep_time=False)
    plan = meshdeploy("plan", path)
    assert plan.returncode == 0, plan.stderr
    assert "node1/llama_cpp.build will be updated in-place" in plan.stdout, plan.stdout
    assert f"pack {key} for node3 to copy (no compile)" in plan.stdout, plan.stdout
    done = meshdeploy("apply", path, "--auto-approve")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sh(info, "node3", f"readlink {PREFIX}/current").endswith(key)
    assert "refused" not in done.stdout + done.stderr


def test_a_rollback_switches_back_without_compile_or_copy(applied):
    info, path, _, _, _ = applied
    key = sh(info, "node3", f"readlink {PREFIX}/current").rsplit("/", 1)[-1]
    older = "0123456789ab-cpu-00000000"
    sh(info, "node3", f"cp -a {PREFIX}/builds/{key} {PREFIX}/builds/{older} && "
                      f"sed -i 's/^key=.*/key={older}/' {PREFIX}/builds/{older}/manifest && "
                      f"ln -sfn builds/{older} {PREFIX}/current")
    plan = meshdeploy("plan", path)
    assert "switch to an existing build (no compile)" in plan.stdout, plan.stdout
    done = meshdeploy("apply", path, "--auto-approve")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sh(info, "node3", f"readlink {PREFIX}/current") == f"builds/{key}"
    assert "llama_cpp.copy" not in host_lines(done.stdout, "node3")
    assert sh(info, "node3", f"ls {PREFIX}/builds").split() == sorted([key, older])
    again = meshdeploy("plan", path, "--detailed-exitcode")
    assert again.returncode == 0 and again.stdout.strip().endswith(NO_CHANGES), again.stdout


def test_a_host_that_joins_copies_through_the_allow_list_opened_before_the_copy(applied):
    """node3 leaves the cluster file, and node1's allow-list then opens md-share's port to node2
    alone; node3 comes back without a build, as a new host would. network.allowlist runs before
    llama_cpp.copy, so node1's table lets node3 in before node3 fetches (the other way round,
    node1's firewall dropped the fetch and the apply stopped there every time)."""
    info, path, _, _, _ = applied
    whole = path.read_text()
    path.write_text(without_host(whole, "node3"))
    try:
        shrunk = meshdeploy("apply", path, "--auto-approve")
        assert shrunk.returncode == 0, shrunk.stdout + shrunk.stderr
        table = sh(info, "node1", "nft list table inet meshdeploy")
        assert "10.200.0.12/31" not in table and "10.200.0.13" not in table, table
        sh(info, "node3", f"rm -rf {PREFIX}/builds {PREFIX}/current")
    finally:
        path.write_text(whole)
    joined = meshdeploy("apply", path, "--auto-approve")
    assert joined.returncode == 0, joined.stdout + joined.stderr
    key, _ = tarball_of(info)
    assert sh(info, "node3", f"readlink {PREFIX}/current") == f"builds/{key}"
    assert "llama_cpp.copy" in host_lines(joined.stdout, "node3")
    assert "10.200.0.12/31" in sh(info, "node1", "nft list table inet meshdeploy")
    again = meshdeploy("plan", path, "--detailed-exitcode")
    assert again.returncode == 0 and again.stdout.strip().endswith(NO_CHANGES), again.stdout
