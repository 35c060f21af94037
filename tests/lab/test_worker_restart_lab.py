"""A worker's rpc-server restarted after its llama-server, on the shared converged lab
(conftest's converged_lab: node1 orchestrator, node2 and node3 workers).

llama-server keeps one connection to each rpc-server it placed weights on; a worker restarted
by hand (or by systemd after a crash) closes it, and llama-server's next request aborts on
it. First that failure, for real; then the plan sees the worker without its client
(services.RpcClients) and restarts llama-server; the chat answers; the next plan says
No changes.
"""

from __future__ import annotations

import json
import time

import pytest
from support.cli import meshdeploy

from meshdeploy.errors import OK

pytestmark = [pytest.mark.lab, pytest.mark.build]

CHAT = ("curl -s -o /dev/null -w '%{http_code}' -m 60 http://127.0.0.1:8080/completion "
        "-H 'Content-Type: application/json' -d " +
        "'" + json.dumps({"prompt": "Hello", "n_predict": 4, "temperature": 0}) + "'")


def clients(info, host: str) -> str:
    return info.run(host, "ss -Htn state established '( sport = :50052 )'", check=True).stdout


def weighted(plan: str, host: str) -> bool:
    """Whether the plan's placement table gives `host`'s rpc-server layers."""
    row = next(line.split() for line in plan.splitlines()
               if line.startswith(f"{host}:50052/"))
    return row[1] != "-"


def healthy(info, seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while info.run("node1", "curl -sf -m 5 http://127.0.0.1:8080/health").returncode != 0:
        assert time.monotonic() < deadline, "llama-server never became healthy again"
        time.sleep(1)


def test_a_worker_restarted_after_its_server_gets_the_server_restarted(converged_lab, tmp_path):
    """The plan's restart rule, for a server without failover (failover.tolerate: 0): there
    llama-server itself holds the workers' connections, and nothing reconnects them but a
    restart. (With failover, md-failover sees the worker close the connection and reconnects:
    tests/lab/test_failover_lab.py.)"""
    info, _, converged = converged_lab
    text = converged.read_text()
    assert "    ctx_size: 2048\n" in text
    cluster = tmp_path / "lab.yaml"
    cluster.write_text(text.replace("    ctx_size: 2048\n",
                                    "    ctx_size: 2048\n    failover: {tolerate: 0}\n", 1))
    lock = converged.with_name(converged.stem + ".lock.json")
    if lock.exists():
        (tmp_path / lock.name).write_text(lock.read_text())
    try:
        _restart_rule(info, cluster)
    finally:
        assert meshdeploy("apply", converged, "--auto-approve").returncode == OK


def _restart_rule(info, cluster):
    # Other modules restart the shared lab's workers by hand (logs): converge first.
    assert meshdeploy("apply", cluster, "--auto-approve").returncode == OK
    plan = meshdeploy("plan", cluster).stdout
    assert plan.rstrip().endswith("No changes. The cluster matches the configuration.")
    # A worker the placement gives layers: after a `bench --sweep`, placement: auto may give one
    # worker everything and the other nothing. llama-server connects to that one too, but a
    # restart of it breaks nothing (requests still answer 200: seen on this lab), so the rule
    # leaves it alone.
    worker = next(h for h in ("node2", "node3") if weighted(plan, h))
    assert clients(info, worker).strip(), "llama-server holds a connection to the worker"

    info.run(worker, "systemctl restart meshdeploy-rpc-50052", root=True, check=True)
    assert not clients(info, worker).strip()
    plan = meshdeploy("plan", cluster)
    assert plan.returncode == OK, plan.stderr
    assert "node1/services.llama_server[main] will be updated in-place" in plan.stdout
    assert f"workers restarted after it hold no connection from it ({worker}:50052)" \
        in plan.stdout
    assert "services.rpc_server" not in plan.stdout  # the workers are as the file wants them

    # The failure the restart prevents: the next request aborts llama-server (curl gets no
    # answer: 000), and systemd starts it again.
    assert info.run("node1", CHAT).stdout.strip() == "000"
    healthy(info)
    # llama-server came back and connected again: nothing left to do.
    assert clients(info, worker).strip()
    assert meshdeploy("plan", cluster).stdout.rstrip().endswith(
        "No changes. The cluster matches the configuration.")

    # Again, and this time the apply restarts llama-server before any request meets it.
    info.run(worker, "systemctl restart meshdeploy-rpc-50052", root=True, check=True)
    apply = meshdeploy("apply", cluster, "--auto-approve")
    assert apply.returncode == OK, apply.stdout + apply.stderr
    assert "services.llama_server[main]" in apply.stdout
    assert info.run("node1", CHAT).stdout.strip() == "200"
    assert clients(info, worker).strip()
    assert meshdeploy("plan", cluster).stdout.rstrip().endswith(
        "No changes. The cluster matches the configuration.")


def test_a_worker_without_layers_restarted_is_left_alone(converged_lab, tmp_path):
    """A worker the split gives no layers is left off llama-server's --rpc list: llama-server
    never connects to it, its restart breaks no request, and the plan restarts nothing for
    it."""
    info, _, cluster = converged_lab
    text = cluster.read_text()
    assert "    ctx_size: 2048\n" in text
    split = tmp_path / "split.yaml"
    split.write_text(text.replace("    ctx_size: 2048\n", "    ctx_size: 2048\n"
                                  "    tensor_split: [0, 1]\n"))
    try:
        assert meshdeploy("apply", split, "--auto-approve").returncode == OK
        plan = meshdeploy("plan", split).stdout
        assert plan.rstrip().endswith("No changes. The cluster matches the configuration.")
        assert not weighted(plan, "node2") and weighted(plan, "node3")
        assert not clients(info, "node2").strip(), "llama-server connects to node2"

        info.run("node2", "systemctl restart meshdeploy-rpc-50052", root=True, check=True)
        assert not clients(info, "node2").strip()
        assert meshdeploy("plan", split).stdout.rstrip().endswith(
            "No changes. The cluster matches the configuration.")
        for _ in range(2):
            assert info.run("node1", CHAT).stdout.strip() == "200"
    finally:
        assert meshdeploy("apply", cluster, "--auto-approve").returncode == OK
