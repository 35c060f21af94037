"""The allow-list on real hosts: a rogue host on the lab bridge reaches a worker until node2
loads the network role's table, then only the orchestrator does; deleting the table is drift.

Runs on its own lab, `mdsec` (3 hosts as inventories/lab.yaml describes them, plus node4, the
rogue, in no cluster file), never the shared `mdlab`; no mirrors and no llama.cpp build: the
worker is a TCP listener on node2:50052 (python3 -m http.server), which is all a firewall sees.
The table and commands are exactly what the role renders for inventories/lab.yaml's node2,
run as the engine runs them (sudo through meshdeploy.core.shell).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from conftest import own_lab

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import shell
from meshdeploy.roles.network import facts, rules

pytestmark = pytest.mark.lab

LOCKDOWN_LAB = "mdsec"
CLUSTER = Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml"
WORKER, PORT = "node2", 50052
LISTENER = "md-lockdown-listener"
CONNECT_TIMEOUT = 2.0
# Prints "open", or "closed <why>": a connect attempt with a deadline, from inside a host.
PROBE = ("import socket, sys\n"
         "try:\n"
         "    address = (sys.argv[1], int(sys.argv[2]))\n"
         "    socket.create_connection(address, float(sys.argv[3])).close()\n"
         "    print('open')\n"
         "except OSError as e:\n"
         "    print('closed', type(e).__name__)\n")


@pytest.fixture(scope="module")
def sec_lab(lab_available, request):
    """LabInfo of lab mdsec (node1..node3 + rogue node4), always removed afterwards."""
    with own_lab(request, LOCKDOWN_LAB, hosts=3, rogue=1, mirrors=False) as (info, _):
        yield info


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(CLUSTER)


def reach(lab, source: str, address: str, port: int = PORT) -> str:
    proc = lab.run(source, ["python3", "-c", PROBE, address, str(port), str(CONNECT_TIMEOUT)],
                   timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def root(lab, host: str, command: str) -> subprocess.CompletedProcess:
    proc = lab.run(host, shell.sudo(command), timeout=60)
    assert proc.returncode == 0, f"{host}: {command[:200]}: {proc.stderr}"
    return proc


def start_listener(lab) -> None:
    root(lab, WORKER, shell.command(
        "systemctl", "is-active", "--quiet", LISTENER, shell.OR, "systemd-run", "--quiet",
        f"--unit={LISTENER}", "python3", "-m", "http.server", PORT, "--bind", "0.0.0.0"))
    deadline = time.monotonic() + 20
    while reach(lab, WORKER, "127.0.0.1") != "open":
        assert time.monotonic() < deadline, "the listener on node2 never opened its port"
        time.sleep(0.3)


def lock_down(lab, cluster) -> None:
    for command in rules.apply_commands(rules.nft_file(cluster, cluster.host(WORKER))):
        root(lab, WORKER, command)


def live_allowlist(lab, host: str = WORKER):
    """facts.Allowlist as a probe reads it: as root, stderr dropped, empty output = default."""
    out = lab.run(host, shell.sudo(facts.Allowlist().command()), timeout=30).stdout.splitlines()
    return facts.Allowlist().process(out) if out else facts.Allowlist.default()


def machine_ruleset() -> str:
    return subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout


def test_rogue_reaches_the_worker_until_the_allowlist_is_loaded(sec_lab, cluster):
    lab = sec_lab
    assert lab.rogue == ["node4"]
    rogue = lab.rogue[0]
    assert rogue not in [h.name for h in cluster.hosts]
    worker = lab.host(WORKER).address
    start_listener(lab)
    # What the role's destroy runs: a lab kept up (--keep-lab) starts over from here too.
    for command in rules.remove_commands():
        root(lab, WORKER, command)
    assert live_allowlist(lab) is None
    # Before: anyone on the bridge connects (what issue 12 found), so the check below can fail.
    assert reach(lab, rogue, worker) == "open"
    assert reach(lab, "node1", worker) == "open"

    lock_down(lab, cluster)

    assert reach(lab, rogue, worker).startswith("closed")
    assert reach(lab, "node3", worker).startswith("closed")  # a worker is no orchestrator
    assert reach(lab, "node1", worker) == "open"  # the orchestrator in inventories/lab.yaml
    assert reach(lab, WORKER, worker) == "open"  # the host itself, to its own address
    assert reach(lab, WORKER, "127.0.0.1") == "open"
    # The other ports of the host are untouched: the rogue still reaches node2's sshd.
    assert reach(lab, rogue, worker, 22) == "open"

    wanted = rules.allowlist(cluster, cluster.host(WORKER))
    assert live_allowlist(lab) == wanted == {"50052": ["lo", "10.200.0.11"]}
    assert rules.diffs(wanted, live_allowlist(lab)) == []
    # The drops are counted where an operator looks.
    listing = root(lab, WORKER, shell.command("nft", "list", "table", "inet", "meshdeploy"))
    assert "counter packets 0 " not in listing.stdout
    # The lab's namespaces keep the machine's own ruleset out of it.
    assert "meshdeploy" not in machine_ruleset()


def test_deleting_the_table_is_drift_the_fact_reports(sec_lab, cluster):
    lab, rogue = sec_lab, sec_lab.rogue[0]
    worker = lab.host(WORKER).address
    start_listener(lab)
    lock_down(lab, cluster)
    wanted = rules.allowlist(cluster, cluster.host(WORKER))
    assert live_allowlist(lab) == wanted

    root(lab, WORKER, shell.command("nft", "delete", "table", "inet", "meshdeploy"))
    assert live_allowlist(lab) is None
    assert [d.name for d in rules.diffs(wanted, None)] == ["tcp/50052"]
    assert reach(lab, rogue, worker) == "open"

    # A hand edit inside the table is drift too, and applying again repairs both.
    lock_down(lab, cluster)
    root(lab, WORKER, shell.command("nft", "insert", "rule", "inet", "meshdeploy", "input",
                                    "tcp", "dport", PORT, "ip", "saddr", "10.200.0.14",
                                    "accept"))
    assert live_allowlist(lab)["50052"] == ["lo", "10.200.0.11", "10.200.0.14"]
    assert reach(lab, rogue, worker) == "open"
    lock_down(lab, cluster)
    assert live_allowlist(lab) == wanted
    assert reach(lab, rogue, worker).startswith("closed")


def test_the_allowlist_comes_back_after_a_reboot(sec_lab, cluster):
    lab, rogue = sec_lab, sec_lab.rogue[0]
    worker = lab.host(WORKER).address
    lock_down(lab, cluster)
    booted = lab.run(WORKER, "cut -d' ' -f22 /proc/1/stat").stdout.strip()
    lab.run(WORKER, "sudo systemctl reboot")
    deadline = time.monotonic() + 90
    while True:
        time.sleep(1)
        now = lab.run(WORKER, "systemctl is-system-running; cut -d' ' -f22 /proc/1/stat",
                      timeout=15).stdout.split()
        if now[-1:] and now[-1] != booted and now[0] in ("running", "degraded"):
            break
        assert time.monotonic() < deadline, f"{WORKER} did not come back: {now}"
    # meshdeploy-nftables.service loaded the kept file at boot, before anything listened.
    assert live_allowlist(lab) == rules.allowlist(cluster, cluster.host(WORKER))
    start_listener(lab)
    assert reach(lab, rogue, worker).startswith("closed")
    assert reach(lab, "node1", worker) == "open"


def test_tools_fact_finds_nft_for_the_login_user(sec_lab):
    out = sec_lab.run(WORKER, facts.Tools().command()).stdout.splitlines()
    assert facts.Tools().process(out) == ["nft"]
