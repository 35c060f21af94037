"""The network role's typed settings: the cluster file's `network:` section (schema.json in this
folder), and the cluster's network as every other layer reads it.

config/model.py's `Network` is the core's interface to the network: a plain LAN, every port
filtered, nothing public. This role's `Settings` is that interface for the file's section (the
transport, WireGuard's tunnel, OpenSSH's forwards), and `complete` (cluster_file.py, run by
core.loading before any check) puts it on the Cluster with the rpc-servers' binds its rules
decide. Outside this role, code reads the network through the interface's members only.
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, replace
from typing import Any, Literal

from meshdeploy.config.addresses import is_loopback
from meshdeploy.config.model import Cluster, Host, Network, RpcServer, SshForward, parse_rpc_ref

SECTION = "network"  # the role's section of the cluster file


@dataclass(frozen=True)
class WireGuard:
    """network.wireguard: the tunnel between each orchestrator and its workers."""

    subnet: str = "10.99.0.0/16"
    listen_port: int = 51820
    interface: str = "mdwg0"
    addresses: tuple[tuple[str, str], ...] = ()  # explicit (host name, address) pairs

    def address(self, host_name: str) -> str:
        """The host's tunnel address: the explicit one, else derived from its name alone (so it
        stays put when other hosts come and go; checks.py refuses two hosts on one)."""
        for name, address in self.addresses:
            if name == host_name:
                return address
        return derived_tunnel_address(self.subnet, host_name)

    @property
    def unit(self) -> str:
        """The systemd unit that brings the interface up (wg-quick's template)."""
        return f"wg-quick@{self.interface}"


def derived_tunnel_address(subnet: str, host_name: str) -> str:
    """subnet's network address + 1 + (first 8 bytes of sha256(name) mod the usable hosts)."""
    net = ipaddress.IPv4Network(subnet)
    usable = max(net.num_addresses - 2, 1)
    digest = int.from_bytes(hashlib.sha256(host_name.encode()).digest()[:8], "big")
    return str(net.network_address + 1 + digest % usable)


@dataclass(frozen=True)
class SshTransport:
    # Below Linux's ephemeral ports (32768-60999): in that range a client connection of the
    # orchestrator's own (a health poll on loopback) can hold the port the forward must bind
    # (seen in the lab: "bind [127.0.0.1]:51000: Address already in use").
    local_port_base: int = 31000
    # The workers' ports where the forwards' reverse ends carry md-share back (one per sharing
    # host, file order): below the ephemeral ports too, and apart from local_port_base's.
    share_port_base: int = 30180


@dataclass(frozen=True)
class Settings(Network):
    """network: the file's section, as the core's Network interface."""

    rpc_bind: Literal["address", "loopback"] = "address"
    transport: Literal["plain", "wireguard", "ssh"] = "plain"
    wireguard: WireGuard = WireGuard()
    ssh: SshTransport = SshTransport()

    @property
    def tunnel(self) -> bool:
        return self.transport == "wireguard"

    @property
    def forwarded(self) -> bool:
        """network.transport: ssh: orchestrators reach remote rpc-servers through forwards."""
        return self.transport == "ssh"

    @property
    def tunnel_unit(self) -> str | None:
        return self.wireguard.unit if self.tunnel else None

    @property
    def tunnel_interface(self) -> str | None:
        return self.wireguard.interface if self.tunnel else None

    def source_address(self, host: Host) -> str:
        return self.wireguard.address(host.name) if self.tunnel else host.address

    def share_port(self, index: int) -> int | None:
        return self.ssh.share_port_base + index if self.forwarded else None

    def forwards(self, cluster: Cluster, host: Host) -> list[SshForward]:
        """Under network.transport: ssh, the forwards `host` runs for its llama-servers: one per
        remote worker, loopback ports from network.ssh.local_port_base in the order its servers
        list the rpc-servers (an rpc-server on `host` itself is dialled directly)."""
        if not self.forwarded:
            return []
        pairs: list[tuple[str, int]] = []
        for server in cluster.servers:
            if server.host != host.name or not server.rpc:
                continue
            for ref in server.rpc:
                worker, port = parse_rpc_ref(ref)
                if worker != host.name and (worker, port) not in pairs:
                    pairs.append((worker, port))
        base = self.ssh.local_port_base
        by_worker: dict[str, list[tuple[int, int]]] = {}
        for i, (worker, port) in enumerate(pairs):
            by_worker.setdefault(worker, []).append((base + i, port))
        return [SshForward(cluster.host(w), tuple(p)) for w, p in by_worker.items()]


def parse(data: dict[str, Any]) -> Settings:
    """The typed settings of the section's plain data (schema-valid, defaults filled)."""
    wg, ssh = data["wireguard"], data["ssh"]
    return Settings(rpc_bind=data["rpc_bind"], allow_public=data["allow_public"],
                    firewall=data["firewall"], transport=data["transport"],
                    ssh=SshTransport(local_port_base=ssh["local_port_base"],
                                     share_port_base=ssh["share_port_base"]),
                    wireguard=WireGuard(subnet=wg["subnet"], listen_port=wg["listen_port"],
                                        interface=wg["interface"],
                                        addresses=tuple(wg["addresses"].items())))


def of(cluster: Cluster) -> Settings:
    """The cluster's network settings: what complete() put on it; a Cluster that did not come
    through core.loading (a test's) has them made from its section."""
    if isinstance(cluster.network, Settings):
        return cluster.network
    return parse(cluster.sections[SECTION])


def complete(cluster: Cluster) -> Cluster:
    """The cluster with the file's network on it (cluster_file.complete): the settings as its
    `network`, and every rpc-server's bind as the section's rules decide where the file gives
    none (network.rpc_bind, loopback under transport: ssh), and under transport: wireguard the
    tunnel address of a host whose rpc-server another host's llama-server uses."""
    return with_settings(cluster, parse(cluster.sections[SECTION]))


def with_settings(cluster: Cluster, settings: Settings) -> Cluster:
    """`cluster` under `settings` (complete's, or a test's variant)."""
    hosts = tuple(replace(h, rpc_servers=tuple(_bound(settings, h, r) for r in h.rpc_servers))
                  for h in cluster.hosts)
    cluster = replace(cluster, network=settings, hosts=hosts)
    return tunnel_binds(cluster, settings)


def _bound(settings: Settings, host: Host, rpc: RpcServer) -> RpcServer:
    """-H of an rpc-server: the file's bind where it gives one; else loopback under the
    loopback rule or transport: ssh (the forward reaches it there), else the host's IPv4
    address (None for a DNS-named host: the checks ask for a bind). An RpcServer that was not
    read from a file (file_bind None) keeps its bind."""
    if rpc.file_bind is None:
        return rpc
    if rpc.file_bind:
        return replace(rpc, bind=rpc.file_bind)
    if settings.rpc_bind == "loopback" or settings.forwarded:
        return replace(rpc, bind="127.0.0.1")
    try:
        return replace(rpc, bind=str(ipaddress.IPv4Address(host.address)))
    except ValueError:
        return replace(rpc, bind=None)


def tunnel_binds(cluster: Cluster, settings: Settings) -> Cluster:
    """Under network.transport: wireguard, an rpc-server that another host's llama-server uses
    binds its host's tunnel address only; one that only its own host uses binds loopback (it
    has no tunnel to listen on). A loopback bind in the file stays. Unchanged for plain, and
    while the subnet is not a network (checks.py says so)."""
    if not settings.tunnel:
        return cluster
    try:
        ipaddress.IPv4Network(settings.wireguard.subnet)
    except ValueError:
        return cluster
    remote = {parse_rpc_ref(ref) for s in cluster.servers for ref in s.rpc or ()
              if parse_rpc_ref(ref)[0] != s.host}
    hosts = []
    for host in cluster.hosts:
        rpcs = []
        for rpc in host.rpc_servers:
            if rpc.bind is None or not is_loopback(rpc.bind):
                bind = (settings.wireguard.address(host.name)
                        if (host.name, rpc.port) in remote else "127.0.0.1")
                rpc = replace(rpc, bind=bind)
            rpcs.append(rpc)
        hosts.append(replace(host, rpc_servers=tuple(rpcs)))
    return replace(cluster, hosts=tuple(hosts))
