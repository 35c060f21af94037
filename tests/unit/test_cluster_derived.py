"""What a Cluster derives from its file (who fetches tensors or copies models from whom, a
server's rpc-servers) is computed once per Cluster: a plan asks it for every host and slot. A
Cluster made from another by dataclasses.replace() derives its own, never the other's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshdeploy.config import distribution
from meshdeploy.core.loading import load_cluster

ROOT = Path(__file__).resolve().parents[2]


def cached_lab():
    """inventories/lab.yaml with node2's and node3's rpc-servers cached (their tensors fetched
    from node1's copy)."""
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    hosts = tuple(replace(h, rpc_servers=tuple(replace(r, cache=True) for r in h.rpc_servers))
                  for h in cluster.hosts)
    return replace(cluster, hosts=hosts)


def test_a_replaced_cluster_derives_its_own_answers():
    cluster = cached_lab()
    fetches = distribution.tensor_fetches(cluster)
    assert {(f.source, f.worker) for f in fetches} == {("node1", "node2"), ("node1", "node3")}
    assert [h.name for h in distribution.share_clients(cluster, cluster.host("node1"))] == \
        ["node2", "node3"]
    alone = replace(cluster, servers=())  # no llama-server: nobody fetches anything
    assert distribution.tensor_fetches(alone) == []
    assert distribution.share_clients(alone, alone.host("node1")) == []
    assert distribution.tensor_fetches(cluster) == fetches  # the first keeps its own


def test_answers_are_the_clusters_not_the_callers_to_change():
    cluster = cached_lab()
    distribution.tensor_fetches(cluster).clear()
    assert len(distribution.tensor_fetches(cluster)) == 2
    server = cluster.servers[0]
    cluster.rpc_endpoints(server).clear()
    assert [e.host.name for e in cluster.rpc_endpoints(server)] == ["node2", "node3"]


def test_a_server_the_file_does_not_hold_gets_its_own_endpoints():
    cluster = cached_lab()
    server = cluster.servers[0]
    assert len(cluster.rpc_endpoints(server)) == 2
    fewer = replace(server, rpc=server.rpc[:1])
    assert [e.host.name for e in cluster.rpc_endpoints(fewer)] == ["node2"]
    assert len(cluster.rpc_endpoints(server)) == 2


def test_a_root_worker_takes_no_tensor_from_a_rootless_source():
    """A rootless source writes the digest list its workers check tensors against: a worker
    with root copies the whole GGUF instead (checked against the Hub's sha256); a rootless
    worker, of equal rank, still fetches its tensors."""
    cluster = cached_lab()
    hosts = tuple(replace(h, rootless=h.name in ("node1", "node3")) for h in cluster.hosts)
    mixed = replace(cluster, hosts=hosts)
    assert distribution.model_source(mixed, "gemma") == "node1"
    assert {(f.source, f.worker) for f in distribution.tensor_fetches(mixed)} == \
        {("node1", "node3")}
    assert {(f.source, f.worker) for f in distribution.copies(mixed)} == {("node1", "node2")}
    assert distribution.keeps(mixed, mixed.host("node2")) == ["gemma"]
