"""Where each service of the cluster logs: its systemd unit, its launchd log file on macOS (on a
runit host: svlogd's `current` file, in the same field), and the words `meshdeploy logs` selects
it by."""

from __future__ import annotations

from meshdeploy.config.model import RUNIT, Cluster, rpc_ref
from meshdeploy.core.registry import LogSource
from meshdeploy.roles.services import defaults as d
from meshdeploy.roles.services.managers import Launchd, log_dir


def log_sources(cluster: Cluster) -> list[LogSource]:
    """rpc-servers, llama-servers and (network.transport: ssh) forwards, hosts in file order
    (rpc-servers first on each host)."""
    launchd = Launchd()
    out = []
    for host in cluster.hosts:
        for rpc in host.rpc_servers:
            out.append(_source(host, f"rpc-server:{rpc.port}", rpc.unit_name, launchd,
                               "rpc-server", rpc_ref(host.name, rpc.port)))
        for server in (s for s in cluster.servers if s.host == host.name):
            out.append(_source(host, f"llama-server:{server.name}", server.unit_name,
                               launchd, "llama-server", server.name))
        for forward in cluster.ssh_forwards(host):
            out.append(_source(host, f"ssh-forward:{forward.worker.name}", forward.unit_name,
                               launchd, "ssh-forward"))
    return out


def _source(host, service: str, unit: str, launchd: Launchd, *names: str) -> LogSource:
    label = launchd.name(unit)
    log = f"{d.services_launchd_log_dir}/{label}.log"
    if host.layout is not None and host.layout.manager == RUNIT:
        log = f"{log_dir(host.layout, unit)}/current"  # svlogd's file, where launchd's would be
    return LogSource(host=host.name, service=service, unit=unit, launchd_log=log,
                     names=frozenset({*names, service, unit, f"{unit}.service", label}))
