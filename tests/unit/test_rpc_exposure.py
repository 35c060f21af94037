"""An rpc-server bound beyond loopback and the private ranges: one typed finding
(checks.ExposedRpc) gives both the plan's warning and the unit's journal line, so no code
decides on a message's text."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshdeploy.config import checks
from meshdeploy.core.loading import load_cluster
from meshdeploy.roles.services import operations as services

ROOT = Path(__file__).resolve().parents[2]
JOURNAL_LINE = ('ExecStartPre=/bin/echo "meshdeploy: WARNING: RPC on this port is '
                'unauthenticated and unencrypted"\n')


def bound(bind: str):
    """The lab with node2's rpc-server bound to `bind`."""
    lab = load_cluster(ROOT / "inventories" / "lab.yaml")
    host = lab.host("node2")
    moved = dataclasses.replace(host, rpc_servers=(
        dataclasses.replace(host.rpc_servers[0], bind=bind),))
    return dataclasses.replace(lab, hosts=(lab.hosts[0], moved, lab.hosts[2]))


def unit(cluster) -> str:
    host = cluster.host("node2")
    return services.rpc_unit(cluster, host, host.rpc_servers[0], "/opt/b", "rpc-server")


@pytest.mark.parametrize("bind,scope", [("0.0.0.0", "every interface"),
                                        ("203.0.113.7", "203.0.113.7")])
def test_an_exposed_rpc_server_is_one_finding_with_its_warning(bind, scope):
    cluster = bound(bind)
    assert checks.exposed_rpc_servers(cluster) == [checks.ExposedRpc("node2", 50052, bind)]
    assert checks.warnings_for(cluster) == [
        f"rpc-server on node2 binds {scope} (port 50052): RPC is unauthenticated and "
        "unencrypted; anyone who reaches it can run code on its devices. Restrict it with a "
        "firewall or a private network."]
    assert JOURNAL_LINE in unit(cluster)


def test_a_private_bind_is_no_finding():
    cluster = bound("10.200.0.12")
    assert checks.exposed_rpc_servers(cluster) == []
    assert JOURNAL_LINE not in unit(cluster)


def test_the_unit_follows_the_finding_not_the_words(monkeypatch):
    """Rewording the warning leaves the unit as it is."""
    cluster = bound("0.0.0.0")
    monkeypatch.setattr(checks.ExposedRpc, "warning", property(lambda self: "reworded"))
    assert checks.warnings_for(cluster) == ["reworded"]
    assert JOURNAL_LINE in unit(cluster)
