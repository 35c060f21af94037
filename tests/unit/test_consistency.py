"""One commit everywhere (the llama_cpp role's check across hosts): drift warnings, the --limit
refusal; the network cost line (the services role's Network rows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import registry
from meshdeploy.errors import PlanError
from meshdeploy.roles.services.rtt import network as rtt_network
from meshdeploy.views.plan import render_network

LAB = Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml"
NEW = "f35b4f837ba8e08a33034faa9ba21db8713e67df"
OLD = "ad0e45df7b3e249551b8eb1229ffdc904b7ba834"


def check(cluster, hosts, facts, commit, limit=()):
    """What the plan's checks across hosts say, through the registry as the planner asks."""
    return registry.checks(registry.Check(cluster, hosts, facts, run_values(commit=commit),
                                          tuple(limit)))


def facts_running(**commits):
    facts = {}
    for host, (commit, proto) in commits.items():
        key = f"{commit[:12]}-cpu-x"
        facts[host] = {"llama_cpp.Builds": {"current": key, "builds": {
            key: {"commit": commit, "proto": proto}}}}
    return facts


def test_drift_is_reported_with_each_hosts_build():
    cluster = load_cluster(LAB)
    facts = facts_running(node1=(NEW, "7.0.0"), node2=(OLD, "5.0.0"), node3=(NEW, "7.0.0"))
    warnings = check(cluster, cluster.hosts, facts, NEW)
    assert warnings == [
        "hosts run different llama.cpp builds: node1 f35b4f837ba8 (RPC 7.0.0), "
        "node2 ad0e45df7b3e (RPC 5.0.0), node3 f35b4f837ba8 (RPC 7.0.0); "
        "apply moves every host to f35b4f837ba8"]


def test_same_commit_everywhere_is_quiet():
    cluster = load_cluster(LAB)
    facts = facts_running(node1=(NEW, "7.0.0"), node2=(NEW, "7.0.0"), node3=(NEW, "7.0.0"))
    assert check(cluster, cluster.hosts, facts, NEW) == []


def test_limit_cannot_move_the_commit_of_some_hosts():
    cluster = load_cluster(LAB)
    hosts = [cluster.host("node2")]
    facts = facts_running(node2=(OLD, "5.0.0"))
    with pytest.raises(PlanError,
                       match=r"--limit node2 would move node2 to llama.cpp f35b4f837ba8"):
        check(cluster, hosts, facts, NEW, ["node2"])
    facts = facts_running(node2=(NEW, "7.0.0"))
    assert check(cluster, hosts, facts, NEW, ["node2"]) == []


def test_network_line_sums_one_round_trip_per_worker():
    cluster = load_cluster(LAB)
    facts = {"node1": {"services.Rtt": {"10.200.0.12:22": 150, "10.200.0.13:22": 2500}}}
    network = rtt_network(cluster, cluster.hosts, facts)
    assert [(e.endpoint, e.rtt_ms, e.remote) for e in network[0].endpoints] == [
        ("10.200.0.12:50052", 0.15, True), ("10.200.0.13:50052", 2.5, True)]
    assert (network[0].round_trips, network[0].per_token_ms) == (2, 2.65)
    assert render_network(network) == ["Network (main on node1): RTT 10.200.0.12:50052 0.15 ms, "
                     "10.200.0.13:50052 2.50 ms; expected per-token cost = compute + 2 x RTT "
                     "(~2.65 ms)"]


def test_an_unreachable_worker_is_named_and_not_counted():
    """No connect got there (a tunnel not up yet): no RTT for it, and the line says so."""
    cluster = load_cluster(LAB)
    facts = {"node1": {"services.Rtt": {"10.200.0.12:22": 150, "10.200.0.13:22": None}}}
    (network,) = rtt_network(cluster, cluster.hosts, facts)
    assert [e.endpoint for e in network.endpoints] == ["10.200.0.12:50052"]
    assert network.unreachable == ["10.200.0.13:50052"]
    assert (network.round_trips, network.per_token_ms) == (1, 0.15)
    assert render_network([network]) == [
        "Network (main on node1): RTT 10.200.0.12:50052 0.15 ms, 10.200.0.13:50052 unreachable "
        "now; expected per-token cost = compute + 1 x RTT (~0.15 ms), not counting 1 unreachable"]


def test_a_worker_faster_than_the_probe_still_counts_as_a_hop():
    cluster = load_cluster(LAB)
    facts = {"node1": {"services.Rtt": {"10.200.0.12:22": 0, "10.200.0.13:22": 530}}}
    (line,) = render_network(rtt_network(cluster, cluster.hosts, facts))
    assert line.endswith("expected per-token cost = compute + 2 x RTT (~0.53 ms)")


@pytest.fixture
def planner_of_two_roles(monkeypatch, tmp_path):
    """engine.make_plan with the llama_cpp and services roles only, and the probe replaced by
    the facts a test gives: (make(facts, limit) -> Planned). The lab's file is copied beside a
    lock file of its own that pins NEW (no mirror to resolve the ref from here)."""
    import json
    from types import SimpleNamespace

    from meshdeploy.engine import planner as engine

    (tmp_path / "lab.yaml").write_text(LAB.read_text())
    lock = {"llama_cpp": {"commit": NEW, "ref": "b11312", "repo": "git://10.200.0.1/llama.cpp.git"}}
    (tmp_path / "lab.lock.json").write_text(json.dumps(lock))
    cluster = load_cluster(tmp_path / "lab.yaml")
    roles = tuple(registry.role(name) for name in ("llama_cpp", "services"))
    monkeypatch.setattr(registry, "roles", lambda: roles)

    def make(facts, limit=None):
        monkeypatch.setattr(engine, "gather", lambda session, hosts, destroying=(): facts)
        hosts = [h for h in cluster.hosts if not limit or h.name in limit]
        session = SimpleNamespace(cluster=cluster, hosts=lambda: hosts, departed=[],
                                  limit=limit, warnings=lambda: [], read_remote=None)
        return engine.make_plan(session)

    return make


def test_the_plan_takes_drift_and_network_from_the_roles(planner_of_two_roles):
    facts = facts_running(node1=(NEW, "7.0.0"), node2=(OLD, "5.0.0"), node3=(NEW, "7.0.0"))
    facts["node1"]["services.Rtt"] = {"10.200.0.12:22": 150, "10.200.0.13:22": 2500}
    plan = planner_of_two_roles(facts).plan
    assert [w for w in plan.warnings if "different llama.cpp builds" in w] == [
        "hosts run different llama.cpp builds: node1 f35b4f837ba8 (RPC 7.0.0), "
        "node2 ad0e45df7b3e (RPC 5.0.0), node3 f35b4f837ba8 (RPC 7.0.0); "
        "apply moves every host to f35b4f837ba8"]
    assert [(n.server, n.round_trips, n.per_token_ms) for n in plan.network] == [
        ("main", 2, 2.65)]
    with pytest.raises(PlanError, match=r"--limit node2 would move node2"):
        planner_of_two_roles(facts_running(node2=(OLD, "5.0.0")), ["node2"])
