"""State, removal, destroy and locks on real hosts (lab mdst: node1 orchestrator, node2 and node3
workers).

In order: apply; node3 leaves the file -> the plan destroys its units and allow-list and updates
node1's llama-server, apply does it and keeps node3's build; two applies at once -> the second
is refused naming the first (same folder: the control machine's lock; a copy of the file in
another folder, as a second operator's machine: the hosts' lock); a killed apply's lock is taken
over as stale; the state file deleted -> rebuilt from the hosts, the next plan is empty;
`destroy` -> no unit, table or tunnel of meshdeploy's on any host, builds and models kept;
`destroy --purge` -> those gone too, the toolchain's packages still installed (cmake on node1,
which compiles; curl on node2 and node3, which copy node1's build and get no build tools).
"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import own_lab
from support.labfile import lab_text, without_host, write_lab_file
from support.cli import meshdeploy

from meshdeploy.lab import hosts

pytestmark = [pytest.mark.lab, pytest.mark.build]

NODES = ("node1", "node2", "node3")


def ssh(info, host: str, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(hosts.ssh_argv(Path(info.ssh["config"]), host, command),
                          capture_output=True, text=True, timeout=timeout)


def leftovers(info, host: str) -> dict:
    """What of meshdeploy's is on the host: units (files, running or failed), nft table, tunnel, build,
    models, caches, and which of the toolchain's packages is still installed: cmake (a host that
    compiles), else curl (a host that copies its build gets that, and no build tools)."""
    script = ("ls /etc/systemd/system | grep -c '^meshdeploy-' ; "
              # A removed unit may linger in systemd's memory as not-found/inactive until
              # it is garbage-collected: only one that runs or failed counts.
              "echo $(systemctl list-units --all --no-legend --plain 'meshdeploy-*' "
              "| awk '$3 != \"inactive\" {print $1 \"/\" $3 \"/\" $4}' | grep . || echo 0) "
              "| tr ' ' , ; "
              "sudo nft list table inet meshdeploy >/dev/null 2>&1 && echo table || echo none; "
              "ip link show mdwg0 >/dev/null 2>&1 && echo tunnel || echo none; "
              "ls -d /opt/meshdeploy/builds/* 2>/dev/null | grep -c . ; "
              "ls /opt/meshdeploy/models 2>/dev/null | grep -c . ; "
              "sudo sh -c 'ls -d /var/cache/private/meshdeploy-rpc-* 2>/dev/null' | grep -c . ; "
              "if dpkg -s cmake >/dev/null 2>&1; then echo cmake; "
              "elif dpkg -s curl >/dev/null 2>&1; then echo curl; else echo none; fi")
    out = ssh(info, host, script).stdout.split()
    keys = ("unit_files", "units_loaded", "table", "tunnel", "builds", "models", "caches",
            "toolchain")
    return dict(zip(keys, out))


@pytest.fixture(scope="module")
def st_lab(lab_available, request):
    with own_lab(request, "mdst", hosts=3) as both:
        yield both


@pytest.fixture(scope="module")
def files(st_lab, tmp_path_factory):
    """The lab cluster file (all three hosts) and the same without node3, in one folder; a copy
    in a second folder plays a second operator's machine."""
    info, _ = st_lab
    folder = tmp_path_factory.mktemp("state")
    full = write_lab_file(info, folder)
    other = tmp_path_factory.mktemp("operator2") / "lab.yaml"
    return {"full": full, "without_node3": without_host(full.read_text(), "node3"), "other": other,
            "folder": folder}


@pytest.fixture(scope="module")
def converged(files):
    applied = meshdeploy("apply", files["full"], "--auto-approve")
    assert applied.returncode == 0, applied.stderr
    state = json.loads((files["folder"] / "lab.state.json").read_text())
    assert sorted(state["hosts"]) == list(NODES) and state["format_version"] == 1
    return applied


@pytest.fixture(scope="module")
def node3_removed(converged, files, st_lab):
    info, _ = st_lab
    files["full"].write_text(files["without_node3"])
    plan = meshdeploy("plan", files["full"])
    assert plan.returncode == 0, plan.stderr
    applied = meshdeploy("apply", files["full"], "--auto-approve")
    assert applied.returncode == 0, applied.stderr
    return {"plan": plan.stdout, "apply": applied}


def test_removed_host_is_planned_for_destroy(node3_removed):
    text = node3_removed["plan"]
    assert "# node3/services.rpc_server[50052] will be destroyed" in text
    assert "# node3/network.allowlist will be destroyed" in text
    assert "# node1/services.llama_server[main] will be updated in-place" in text
    assert "Kept on the hosts that leave" in text and "node3: " in text
    # node1 compiled the build node2 and node3 copied: md-share's port there closes to node3.
    assert "# node1/network.allowlist will be updated in-place" in text
    assert "Plan: 0 to add, 2 to change, " in text and "0 to destroy" not in text


def test_removed_host_runs_nothing_and_keeps_its_build(node3_removed, st_lab):
    info, _ = st_lab
    left = leftovers(info, "node3")
    assert left["unit_files"] == "0" and left["units_loaded"] == "0", left
    assert left["table"] == "none", left
    assert int(left["builds"]) >= 1, left
    # The orchestrator still answers, now on node2 alone.
    health = ssh(info, "node1", "curl -s http://127.0.0.1:8080/health")
    assert '"ok"' in health.stdout, health.stdout


def test_after_removal_the_plan_is_empty(node3_removed, files):
    again = meshdeploy("plan", files["full"], "--detailed-exitcode")
    assert again.returncode == 0, again.stdout + again.stderr
    state = json.loads((files["folder"] / "lab.state.json").read_text())
    assert state["hosts"]["node3"]["status"] == "retired"


def _waiting_apply(cluster: Path):
    """An apply of a change that holds its locks at the confirmation prompt (a terminal:
    a pty), as an operator who has not answered yet. Returns (process, the pty's writer)."""
    writer, reader = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "meshdeploy", "apply", str(cluster)],
                            stdin=reader, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    os.close(reader)
    return proc, writer


def _wait_for_host_lock(info, proc, seconds=120) -> str:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        owner = ssh(info, "node1", "sudo cat /run/meshdeploy/apply.lock/owner 2>/dev/null").stdout
        if owner.strip():
            return owner
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    raise AssertionError("the first apply never took the host lock")


def test_a_second_apply_is_refused_naming_the_first(node3_removed, files, st_lab):
    info, _ = st_lab
    files["full"].write_text(files["without_node3"].replace("ctx_size: 2048", "ctx_size: 1024"))
    first, writer = _waiting_apply(files["full"])
    try:
        owner = json.loads(_wait_for_host_lock(info, first))
        assert owner["pid"] == first.pid and owner["command"] == "apply"
        # Another terminal, same folder: the control machine's lock.
        same = meshdeploy("apply", files["full"], "--auto-approve")
        assert same.returncode == 8, same.stderr
        assert "locked by meshdeploy apply of" in same.stderr and f"pid {first.pid}" in same.stderr
        # Another operator's checkout: only the hosts' lock can tell.
        files["other"].write_text(files["full"].read_text())
        other = meshdeploy("apply", files["other"], "--auto-approve")
        assert other.returncode == 8, other.stderr
        assert f"pid {first.pid}" in other.stderr and "last heartbeat" in other.stderr
        # -lock-timeout waits, then gives up naming the holder.
        waited = meshdeploy("apply", files["other"], "--auto-approve", "-lock-timeout=5s")
        assert waited.returncode == 8 and waited.seconds >= 5, waited.stderr
    finally:
        os.write(writer, b"no\n")
        out, err = first.communicate(timeout=300)
        os.close(writer)
    assert first.returncode == 7, err  # cancelled: nothing changed
    # The host lock is gone; only the guarded steps' folder (core/inflight.py) may stay.
    left = ssh(info, "node1", "sudo ls -A /run/meshdeploy").stdout.split()
    assert [name for name in left if name != "steps"] == [], left


def test_a_killed_applys_lock_is_taken_over_as_stale(node3_removed, files, st_lab):
    info, _ = st_lab
    first, writer = _waiting_apply(files["full"])  # still the ctx_size 1024 change
    _wait_for_host_lock(info, first)
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate()
    os.close(writer)
    held = ssh(info, "node1", "sudo cat /run/meshdeploy/apply.lock/owner").stdout
    assert f'"pid": {first.pid}' in held, held  # the lock outlived its holder
    files["full"].write_text(files["without_node3"])
    again = meshdeploy("apply", files["full"], "--auto-approve")
    assert again.returncode == 0, again.stderr
    assert "took over a stale lock" in again.stdout and f"pid {first.pid}" in again.stdout


def test_a_lost_state_is_rebuilt_from_the_hosts(node3_removed, files):
    path = files["folder"] / "lab.state.json"
    before = json.loads(path.read_text())
    path.unlink()
    rebuilt = meshdeploy("state", "rebuild", files["full"])
    assert rebuilt.returncode == 0, rebuilt.stderr
    after = json.loads(path.read_text())
    managed = sorted(n for n, r in before["hosts"].items() if r["status"] == "managed")
    assert sorted(after["hosts"]) == managed == ["node1", "node2"]
    for name in managed:
        assert after["hosts"][name]["units"] == before["hosts"][name]["units"]
    plan = meshdeploy("plan", files["full"], "--detailed-exitcode")
    assert plan.returncode == 0, plan.stdout


def test_a_damaged_state_is_one_clear_error(node3_removed, files, tmp_path):
    path = files["folder"] / "lab.state.json"
    good = path.read_bytes()
    try:
        path.write_text("{not json")
        plan = meshdeploy("plan", files["full"])
        assert plan.returncode != 0 and "Traceback" not in plan.stderr
        assert "lab.state.json: not a meshdeploy state file" in plan.stderr
        assert "state rebuild" in plan.stderr
    finally:
        path.write_bytes(good)


def test_destroy_removes_units_tables_and_tunnels_and_keeps_builds(node3_removed, files,
                                                                   st_lab):
    info, _ = st_lab
    files["full"].write_text(files["without_node3"])
    refused = meshdeploy("destroy", files["full"])
    assert refused.returncode != 0 and "--auto-approve" in refused.stderr
    destroyed = meshdeploy("destroy", files["full"], "--auto-approve")
    assert destroyed.returncode == 0, destroyed.stderr
    assert "will be destroyed" in destroyed.stdout and "Kept on the hosts" in destroyed.stdout
    for host in NODES:
        left = leftovers(info, host)
        assert left["unit_files"] == "0" and left["units_loaded"] == "0", (host, left)
        assert left["table"] == "none" and left["tunnel"] == "none", (host, left)
        assert int(left["builds"]) >= 1, (host, left)
    assert int(leftovers(info, "node1")["models"]) >= 1


def _only_the_toolchain(info, host: str) -> None:
    left = leftovers(info, host)
    assert left == {"unit_files": "0", "units_loaded": "0", "table": "none",
                    "tunnel": "none", "builds": "0", "models": "0", "caches": "0",
                    "toolchain": "cmake" if host == "node1" else "curl"}, (host, left)
    rest = ssh(info, host, "ls -A /opt/meshdeploy /etc/meshdeploy 2>&1; "
                           "ls /etc/apt/apt.conf.d | grep meshdeploy").stdout
    assert rest.count("No such file") == 2 and "meshdeploy-proxy" not in rest, (host, rest)


def test_destroy_purge_leaves_only_the_toolchain(node3_removed, files, st_lab):
    info, _ = st_lab
    purged = meshdeploy("destroy", files["full"], "--auto-approve", "--purge")
    assert purged.returncode == 0, purged.stderr
    for host in ("node1", "node2"):
        _only_the_toolchain(info, host)
    state = json.loads((files["folder"] / "lab.state.json").read_text())
    assert state["hosts"] == {}
    # node3 left the file before the state was rebuilt, so no state knows it any more: the
    # runbook's way (docs/runbooks/destroy.md) is the file with it again, for one destroy.
    assert int(leftovers(info, "node3")["builds"]) >= 1
    full = files["full"].read_text()
    files["full"].write_text(lab_text(info))
    try:
        only = meshdeploy("destroy", files["full"], "--auto-approve", "--purge", "--limit", "node3")
        assert only.returncode == 0, only.stderr
    finally:
        files["full"].write_text(full)
    _only_the_toolchain(info, "node3")
