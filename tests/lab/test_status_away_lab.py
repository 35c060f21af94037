"""`meshdeploy status` on the converged lab (conftest's converged_lab: node1 orchestrates, node2
and node3 serve rpc-server) with a worker away: node3's SSH port silently dropped inside its
own network namespace (an nftables table of the test's, removed afterwards), as a host whose
link went away looks. status still reports node1 and node2, one row says node3 is
unreachable and why, and the exit code says degraded (the server answers); --limit leaves
node3 out; plan shows the others' plan and names node3. And with every host up, status's probes take no place in the workers' one-place
rpc-server backlog, which llama-server holds."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from support.cli import meshdeploy

from meshdeploy.errors import CONNECT, DEGRADED, OK
from meshdeploy.lab import net

pytestmark = [pytest.mark.lab, pytest.mark.build]

TABLE = "mdtest_status_away"


@pytest.fixture(scope="module")
def lab(converged_lab):
    info, _, path = converged_lab
    return info, path


def backlog(info, host: str) -> str:
    """`ss -Hltn` of rpc-server's listener on `host`: Recv-Q is its queued connections."""
    return info.run(host, "ss -Hltn 'sport = :50052'").stdout.strip()


def queued(info, host: str) -> int:
    return int(backlog(info, host).split()[1])


def test_status_leaves_the_workers_backlog_to_llama_server(lab):
    """llama-server holds each worker's one client place; status's HELLO used to connect
    anyway, and its closed connection stayed queued in the backlog of 1 until rpc-server
    accepted again (a reconnecting llama-server then finds the queue full). It reads the
    worker's socket table instead, and says who holds the worker."""
    info, path = lab
    before = {h: queued(info, h) for h in ("node2", "node3")}
    done = meshdeploy("status", path, "--json", "--window", "0")
    assert done.returncode == OK, done.stdout + done.stderr
    after = {h: queued(info, h) for h in ("node2", "node3")}
    assert after == before, (before, after, {h: backlog(info, h) for h in after})
    rows = {(r["host"], r["service"]): r for r in json.loads(done.stdout)}
    node1 = info.host("node1").address
    for host in ("node2", "node3"):
        row = rows[(host, "rpc-server :50052")]
        assert row["healthy"] and row["answer"].startswith(f"listening (in use by {node1}"), row


def _nft(info, host: str, rules: str) -> None:
    """nftables `rules` in `host`'s network namespace, from this machine (not over SSH)."""
    subprocess.run(["ip", "netns", "exec", net.host_netns(info.name, host), "nft", "-f", "-"],
                   input=rules, text=True, check=True, capture_output=True, timeout=30)


def test_a_worker_away_is_one_row_and_the_others_are_reported(lab):
    info, path = lab
    # Silently dropped, no RST: the lab reaches node3's sshd through `ip netns exec ... nc
    # 127.0.0.1 22` in node3's namespace, so the drop is on its loopback.
    _nft(info, "node3", f"table inet {TABLE} {{\n  chain input {{\n"
                        "    type filter hook input priority -10; policy accept;\n"
                        "    tcp dport 22 drop\n  }\n}\n")
    try:
        started = time.monotonic()
        done = meshdeploy("status", path, "--json", "--window", "0", "--connect-timeout", "3")
        seconds = time.monotonic() - started
        assert done.returncode == DEGRADED, done.stdout + done.stderr
        rows = json.loads(done.stdout)
        assert {r["host"] for r in rows} == {"node1", "node2", "node3"}
        (away,) = [r for r in rows if r["host"] == "node3"]
        assert away["answer"] == "unreachable: timed out" and away["reachable"] is False, away
        assert all(r["healthy"] for r in rows if r["host"] != "node3"), rows
        assert any(r["service"] == "llama-server main" and r["healthy"] for r in rows)
        assert seconds < 25, f"status took {seconds:.1f} s with a 3 s connect timeout"

        text = meshdeploy("status", path, "--window", "0", "--connect-timeout", "3")
        assert text.returncode == DEGRADED, text.stdout + text.stderr
        line = next(li for li in text.stdout.splitlines() if li.startswith("node3"))
        assert "unreachable: timed out" in line and line.split()[-1] == "NO", line
        assert text.stdout.rstrip().splitlines()[-1].endswith("; unreachable: node3")
        assert "llama-server main" in text.stdout

        limited = meshdeploy("status", path, "--window", "0", "--limit", "node1,node2")
        assert limited.returncode == OK, limited.stdout + limited.stderr
        assert "node3" not in limited.stdout

        ran = meshdeploy("exec", path, "--limit", "node3", "--connect-timeout", "2", "--",
                         "true")
        assert ran.returncode == CONNECT and "timed out" in ran.stdout, ran.stdout

        # plan shows the others' plan, names node3 and what its absence means, saves nothing.
        plan = meshdeploy("plan", path, "--connect-timeout", "3", "-out", "away.plan",
                          cwd=path.parent)
        assert plan.returncode == CONNECT, plan.stdout + plan.stderr
        # The per-host table has the others only (what --limit node1,node2 plans, e.g.
        # node1's md-share port no longer open to node3).
        table = [li.split()[0] for li in plan.stdout.splitlines()
                 if re.match(r"node\d\s+\d+\s+\d+\s+\d+\s+\d+$", li)]
        assert table == ["node1", "node2"], plan.stdout[-3000:]
        said = " ".join(plan.stdout.split())
        assert ("node3 could not be reached (timed out): this plan leaves it out, as --limit "
                "would, and changes nothing there; llama-server main on node1 uses its "
                "rpc-server") in said, plan.stdout[-3000:]
        assert "--limit node1,node2" in plan.stderr and "was not saved" in plan.stderr
        assert not (path.parent / "away.plan").exists()
    finally:
        _nft(info, "node3", f"delete table inet {TABLE}\n")
    assert meshdeploy("status", path, "--window", "0").returncode == OK
