"""benchmarks/fleet.py's cluster files: the fleet's (30 hosts, three llama-servers) and the
3-host one validate as meshdeploy reads them, each server with its own even group of workers,
every host of the fleet in one group, none past llama.cpp's 16 rpc-servers per server."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from meshdeploy.core.loading import load_cluster
from meshdeploy.lab.labinfo import LabHost, LabInfo
from meshdeploy.lab.net import host_address, host_names

ROOT = Path(__file__).resolve().parents[2]


def fleet_module():
    spec = importlib.util.spec_from_file_location("fleet", ROOT / "benchmarks" / "fleet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lab_info(count: int) -> LabInfo:
    hosts = [LabHost(n, host_address(n), f"mdfleet-{n}") for n in host_names(count)]
    return LabInfo(name="mdfleet", state_dir="/var/lib/meshdeploy/lab/mdfleet",
                   bridge_address="10.200.0.1", hosts=hosts,
                   ssh={"config": "/var/lib/meshdeploy/lab/mdfleet/ssh_config"},
                   mirrors={"hf_api_endpoint": "http://10.200.0.1:18080"})


def test_the_fleet_and_the_three_host_files_validate(tmp_path):
    fleet = fleet_module()
    info = lab_info(33)
    for hosts, servers in ((info.hosts[:30], 3), (info.hosts[30:], 1)):
        path = tmp_path / f"{len(hosts)}.yaml"
        path.write_text(fleet.cluster_yaml(info, hosts, servers, f"fleet{len(hosts)}"))
        cluster = load_cluster(path)
        assert {h.name for h in cluster.hosts} == {h.name for h in hosts}
        assert len(cluster.servers) == servers
        workers = [w for s in cluster.servers for w in cluster.rpc_endpoints(s)]
        assert len(workers) == len(hosts) - servers  # every other host serves one server
        assert all(len(cluster.rpc_endpoints(s)) <= 16 for s in cluster.servers)
        assert {s.host for s in cluster.servers}.isdisjoint(
            {e.target.split(":")[0] for e in workers})
