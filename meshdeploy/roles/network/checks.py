"""The network role's checks of its section (cluster_file.validate, run by core.loading beside
the config layer's): what JSON Schema cannot say of the transport, the tunnel and the forwards'
ports."""

from __future__ import annotations

import ipaddress

from meshdeploy.config import distribution
from meshdeploy.config.document import Document
from meshdeploy.config.addresses import is_loopback
from meshdeploy.config.model import Cluster, Host
from meshdeploy.config.schema import suggest
from meshdeploy.config.yaml_doc import render_path
from meshdeploy.errors import ConfigIssue
from meshdeploy.roles.network.settings import SECTION, of


def validate(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    for checker in (check_rootless, check_forward_ports, check_ssh_transport, check_wireguard):
        issues += checker(doc, cluster)
    return issues


def check_rootless(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    """A rootless host can hold no WireGuard interface and no allow-list (each needs root): a
    file that asks for them there is refused at the host."""
    net = of(cluster)
    issues = []
    for host in cluster.hosts:
        if not host.rootless:
            continue
        path = ("hosts", host.name, "rootless")
        if net.tunnel:
            issues.append(doc.issue(
                path,
                f"host {host.name} is rootless, but network.transport: wireguard makes a "
                "network interface on every host, which needs root",
                "use network.transport: plain, or give meshdeploy root on the host"))
        elif net.firewall and not host.unprotected and _listens(cluster, host):
            issues.append(doc.issue(
                path,
                f"host {host.name} is rootless, so it cannot hold network.firewall's allow-list "
                "(nftables needs root): its rpc-servers or llama-server would be open to every "
                "machine that reaches it",
                "use network.transport: ssh (rpc-servers then bind loopback and only the "
                f"orchestrators' forwards reach them), or set hosts.{host.name}.unprotected: "
                "true to accept the open ports (warned in every plan)"))
    return issues


def _listens(cluster: Cluster, host: Host) -> bool:
    """Whether the host has a port the allow-list would guard: an rpc-server, or a llama-server
    on a non-loopback bind (one on loopback is reached from the host only)."""
    return any(not is_loopback(r.bind or "") for r in host.rpc_servers) or any(
        s.host == host.name and not is_loopback(s.bind) for s in cluster.servers)


def check_forward_ports(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    """Under network.transport: ssh, each loopback port an orchestrator's forwards listen on
    (from network.ssh.local_port_base) is free on it: no rpc-server, md-share or reverse end of
    a forward there. Said at local_port_base: the ports follow from it. (A llama-server on one
    is told to move at its own port: config.checks.check_ports.)"""
    owners = distribution.derived_ports(cluster)
    for host in cluster.hosts:
        for i, rpc in enumerate(host.rpc_servers):
            owners.setdefault((host.name, rpc.port),
                              render_path(("hosts", host.name, "rpc_servers", i)))
    setting = (SECTION, "ssh", "local_port_base")
    where = setting if doc.written(setting) is not None else (SECTION,)
    issues = []
    for host in cluster.hosts:
        try:
            forwards = cluster.ssh_forwards(host)
        except KeyError:  # an rpc entry names an unknown host: the config checks say so
            forwards = []
        for forward in forwards:
            for local, remote in forward.ports:
                owner = owners.get((host.name, local))
                if owner is not None:
                    issues.append(doc.issue(
                        where,
                        f"port {local} on host {host.name} is taken by {owner}, but the ssh "
                        f"forward to {forward.worker.name}:{remote} listens there",
                        "pick another network.ssh.local_port_base", at_key=True))
    return issues


def check_ssh_transport(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    """network.transport: ssh: every rpc-server binds loopback (the worker's own sshd forwards
    to it). Model bytes need no check: a model has one llama-server, whose host is its source,
    and every host that gets bytes of it (a cached worker's tensors or whole copy) is a worker
    of that server, reached by the source's forward (core/share.py: its reverse end)."""
    if not of(cluster).forwarded:
        return []
    issues = []
    for host in cluster.hosts:
        for i, rpc in enumerate(host.rpc_servers):
            path = ("hosts", host.name, "rpc_servers", i)
            if doc.written(path + ("bind",)) and not is_loopback(rpc.bind or ""):
                issues.append(doc.issue(
                    path + ("bind",),
                    f"binds {rpc.bind}, but under network.transport: ssh an rpc-server listens "
                    "on loopback only: the forward from its orchestrators reaches it there",
                    "remove bind (or bind 127.0.0.1)"))
    return issues


def check_wireguard(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    """network.wireguard: a subnet that is a network, explicit addresses of known hosts inside
    it, and no two hosts on one tunnel address (a derived one can collide: say which)."""
    net_settings = of(cluster)
    if not net_settings.tunnel:
        return []
    wg = net_settings.wireguard
    path = (SECTION, "wireguard")
    try:
        net = ipaddress.IPv4Network(wg.subnet)
    except ValueError as exc:
        return [doc.issue(path + ("subnet",), f"'{wg.subnet}' is not an IPv4 network ({exc})",
                          "write a network with its host bits zero, e.g. 10.99.0.0/16")]
    issues = []
    names = {h.name for h in cluster.hosts}
    for name, address in wg.addresses:
        where = path + ("addresses", name)
        if name not in names:
            issues.append(doc.issue(where, f"no host named {name!r}",
                                    suggest(name, sorted(names), "hosts"), at_key=True))
        elif not _host_address_of(address, net):
            issues.append(doc.issue(where, f"{address} is not a host address of {wg.subnet}",
                                    "pick an address inside network.wireguard.subnet"))
    taken: dict[str, str] = {}
    for host in cluster.hosts:
        address = wg.address(host.name)
        if address in taken:
            issues.append(doc.issue(path, f"hosts {taken[address]} and {host.name} get the same "
                                    f"tunnel address {address}",
                                    f"give one of them its own under network.wireguard."
                                    f"addresses (e.g. {host.name}: <a free address>)",
                                    at_key=True))
        taken.setdefault(address, host.name)
    return issues


def _host_address_of(address: str, net) -> bool:
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        return False
    return ip in net and ip not in (net.network_address, net.broadcast_address)
