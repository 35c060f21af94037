"""The network role's part in loading a cluster file (registry.file_hooks): the file's network
on the typed cluster (settings.complete: the Network every layer reads, the rpc-servers'
binds), its checks of the transport, the tunnel and the forwards' ports (checks.py), and the
risk of its settings said at every validate, plan and apply (warnings)."""

from __future__ import annotations

from meshdeploy.config.model import Cluster
from meshdeploy.roles.network.checks import validate
from meshdeploy.roles.network.settings import complete

__all__ = ["complete", "validate", "warnings"]


def warnings(cluster: Cluster) -> list[str]:
    if cluster.network.firewall:
        return []
    return ["network.firewall: false: no host filters its meshdeploy ports; any machine that "
            "reaches a worker's rpc-server port can read and write its memory"]
