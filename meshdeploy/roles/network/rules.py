"""network: the allow-list of one host's meshdeploy ports, and its nftables table.

Pure: the cluster model in, text and commands out; nothing here talks to a host. Each
rpc-server port accepts TCP from loopback and from the hosts whose llama-servers name it in
`--rpc` (their `address`, where the orchestrator dials from); each llama-server port from
loopback and from what the file allows; both from the Prometheus scrapers of
monitoring.scrapers (an rpc-server port from single scraper addresses only, and only where a
llama-server already reaches it); every other packet to those ports is dropped. Nothing
else is filtered: the chain's policy is accept, and an accept in one nftables table never
overrides a drop in another, so the host's own rules work exactly as before.

rpc-server is unauthenticated and lets any client allocate, read and write the worker's memory
(upstream's own warning: never run it on an open network), so an rpc-server that no llama-server
in the file uses is open to loopback only.

Under network.transport: ssh a root host's rpc-servers bind loopback, which every local user
reaches: an output chain drops a connection to their ports from any local user but root, the
login user (sshd's forwards run as it; meshdeploy's own status probe too) and, where a
llama-server of the host dials its own rpc-server, systemd's DynamicUser= range (local_ports).

```python
allowlist(cluster, cluster.host("node2"))   # {"50052": ["lo", "10.200.0.11"]}
nft_file(cluster, cluster.host("node2"))     # "table inet meshdeploy {}\\ndelete table ..."
allowlist(ssh_cluster, node2, login_uid=1000)   # {"loopback/50052": ["uid 0", "uid 1000"]}
```
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from meshdeploy.config.addresses import is_loopback, is_single_address
from meshdeploy.config import distribution
from meshdeploy.core import registry, shell
from meshdeploy.core.paths import model_share_port
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.units import exec_arg, render
from meshdeploy.errors import PlanError
from meshdeploy.roles.network import defaults as d
from meshdeploy.roles.network import settings

LOOPBACK = d.network_loopback
VIA = " via "  # "10.99.1.2 via mdwg0": accepted from that address arriving on that interface
TABLE = f"{d.network_nft_family} {d.network_nft_table}"
TEMPLATES = Path(__file__).with_name("templates")
# nft keeps at most 128 bytes of a comment; names in the file are [A-Za-z0-9_.-] already.
_COMMENT_UNSAFE = re.compile(r"[^A-Za-z0-9_.,:/ -]")
_COMMENT_MAX = 120


@dataclass(frozen=True)
class Port:
    """One filtered TCP port of a host: who may connect, and what listens there."""

    port: int
    sources: tuple[str, ...]  # normalize()d: "lo" first, then IPv4, then IPv6 networks
    what: str  # "rpc-server", "llama-server main"
    proto: str = "tcp"  # "udp" for WireGuard's listen port

    @property
    def key(self) -> str:
        """The port's name in an allow-list: "50052" for TCP, "udp/51820" otherwise."""
        return port_key(self.proto, self.port)


def port_key(proto: str, port: int) -> str:
    return str(port) if proto == "tcp" else f"{proto}/{port}"


def ports(cluster, host, build_copiers=()) -> list[Port]:
    """The host's meshdeploy ports and their allowed sources, in port order. `build_copiers`: the
    hosts that copy the llama.cpp build this host compiles (the llama_cpp run's build_copiers),
    which its
    md-share serves them."""
    found: dict[tuple[str, int], tuple[list[str], list[str]]] = {}
    tunnel = settings.of(cluster).wireguard if cluster.network.tunnel else None
    for rpc in host.rpc_servers:
        if cluster.network.forwarded and is_loopback(rpc.bind or ""):
            # network.transport: ssh: the rpc-server listens on loopback, where only this host
            # (and the forwards its sshd opens for the orchestrators) reaches it: no rule.
            continue
        peers = [_peer_address(cluster, host, rpc, s) for s in _rpc_clients(cluster, host, rpc)]
        if tunnel is not None:
            # Under WireGuard the orchestrator's tunnel address counts only on the tunnel: the
            # same source on the bridge is not authenticated.
            peers = [f"{p}{VIA}{tunnel.interface}" for p in peers]
        elif peers and not is_loopback(rpc.bind or ""):
            # A scraper's probe reaches the port as its llama-server does, and so could use
            # the worker as one: single addresses only, and only where a llama-server already
            # has the port opened (an unused rpc-server stays loopback-only).
            peers += [a for a in _scrapers(cluster) if is_single_address(a)]
        _add(found, ("tcp", rpc.port), "rpc-server", peers)
    for server in (s for s in cluster.servers if s.host == host.name):
        allow = [_literal(a, f"servers.{server.name}.allow") for a in server.allow]
        if not is_loopback(server.bind):
            allow += _scrapers(cluster)
        _add(found, ("tcp", server.port), f"llama-server {server.name}", allow)
    # Under network.transport: ssh md-share listens on loopback, reached through the forwards'
    # reverse ends: no port to open.
    fetchers = [] if cluster.network.forwarded else distribution.share_clients(cluster, host)
    fetchers += [cluster.host(n) for n in build_copiers
                 if n not in {f.name for f in fetchers}]
    if fetchers:
        # md-share serves this host's model copy to the hosts that fetch tensors or copies of
        # it (models.gguf, rpc_cache.share), over the tunnel when there is one.
        _add(found, ("tcp", model_share_port), "model share",
             [share_source(cluster, host, w) for w in fetchers])
    peers = cluster.tunnel_peers(host) if tunnel is not None else []
    if peers:
        _add(found, ("udp", tunnel.listen_port), "wireguard",
             [_underlay_address(host, peer) for peer in peers])
    return [Port(port, tuple(normalize(([LOOPBACK] if proto == "tcp" else []) + sources)),
                 ", ".join(whats), proto)
            for (proto, port), (sources, whats) in sorted(found.items(),
                                                          key=lambda i: (i[0][1], i[0][0]))]


def allowlist(cluster, host, build_copiers=(), login_uid: int | None = None) -> dict[str, list[str]]:
    """What facts.Allowlist reads back once the table is loaded: port -> sorted sources, and
    "loopback/PORT" -> the local users that may connect (local_ports)."""
    out = {p.key: list(p.sources) for p in ports(cluster, host, build_copiers)}
    out.update({p.key: list(p.uids) for p in local_ports(cluster, host, login_uid)})
    return out


LOCAL = "loopback/"  # the allow-list key of a loopback port's local users: "loopback/50052"


@dataclass(frozen=True)
class LocalPort:
    """A root host's loopback rpc-server port and the local users that may connect to it."""

    port: int
    uids: tuple[str, ...]  # "uid 0", "uid 1000", "uid 61184-65519": uid_order()ed
    what: str

    @property
    def key(self) -> str:
        return f"{LOCAL}{self.port}"


def local_ports(cluster, host, login_uid: int | None) -> list[LocalPort]:
    """Under network.transport: ssh, each loopback rpc-server port of a root host: open to root
    (meshdeploy's own checks run through sudo), the login user `login_uid` (sshd's forwards
    for the orchestrators log in as it, and so does meshdeploy; left out while unknown) and,
    where a llama-server of this host dials the rpc-server directly, systemd's DynamicUser=
    range. Nobody else: a local user would be an unauthenticated RPC client. None on a
    rootless host (no nftables) or another transport."""
    if host.rootless or not cluster.network.forwarded:
        return []
    low, high = d.network_dynamic_uids
    out = []
    for rpc in host.rpc_servers:
        if not is_loopback(rpc.bind or ""):
            continue
        uids = {0} | ({int(login_uid)} if login_uid is not None else set())
        local = any(s.host == host.name for s in _rpc_clients(cluster, host, rpc))
        shown = [f"uid {u}" for u in uids if not (local and low <= u <= high)]
        if local:
            shown.append(f"uid {low}-{high}")
        out.append(LocalPort(rpc.port, tuple(uid_order(shown)), "rpc-server, local users"))
    return out


def uid_order(uids) -> list[str]:
    """"uid N" and "uid A-B" items by their first uid, as nft lists a set's elements."""
    return sorted(set(uids), key=lambda u: int(u.split()[1].partition("-")[0]))


def _rpc_clients(cluster, host, rpc) -> list:
    """llama-servers whose --rpc list names this rpc-server."""
    return [s for s in cluster.servers
            if any(e.host.name == host.name and e.rpc.port == rpc.port
                   for e in cluster.rpc_endpoints(s))]


def _peer_address(cluster, host, rpc, server) -> str:
    orchestrator = cluster.host(server.host)
    return _ip_of(orchestrator, cluster.source_address(orchestrator),
                  f"hosts.{host.name}.rpc_servers[{rpc.port}]: its allow-list needs the address "
                  f"of {orchestrator.name} (llama-server {server.name} uses it)")


def share_source(cluster, host, worker) -> str:
    """The source md-share's port on `host` admits for `worker` (a host that fetches from it):
    its address, on the tunnel when there is one."""
    address = _fetcher_address(cluster, host, worker)
    if cluster.network.tunnel:
        return f"{address}{VIA}{settings.of(cluster).wireguard.interface}"
    return address


def _fetcher_address(cluster, host, worker) -> str:
    return _ip_of(worker, cluster.source_address(worker),
                  f"hosts.{host.name}: its model share must accept {worker.name}, which gets its "
                  "model bytes from there")


def _underlay_address(host, peer) -> str:
    return _ip_of(peer, peer.address,
                  f"hosts.{host.name}: its WireGuard port must accept {peer.name}")


def _ip_of(peer, address: str, why: str) -> str:
    """`address` (of host `peer`) as the IP literal a rule holds; a DNS name is one error that
    says `why` the rule needs it."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        raise PlanError(
            f"{why}, but hosts.{peer.name}.address is {peer.address!r}, a DNS name; nftables and "
            "pf rules hold IP addresses",
            hint=f"give hosts.{peer.name}.address as the IP address it connects from") from None


def _scrapers(cluster) -> list[str]:
    """Where the roles' own services reach the cluster's ports from (registry.admitted:
    monitoring.scrapers, where Prometheus scrapes each llama-server's /metrics and probes each
    rpc-server's port from). Opened on ports a scraper can reach (not loopback, not inside a
    WireGuard tunnel)."""
    return [_literal(a, "monitoring.scrapers") for a in registry.admitted(cluster)]


def _literal(value: str, where: str) -> str:
    try:
        return str(ipaddress.ip_network(value, strict=True))
    except (ValueError, TypeError):
        raise PlanError(f"{where}: {value!r} is not an IP address or network",
                        hint="write an address (10.0.0.5) or a network (10.0.0.0/24)") from None


def _add(found: dict, port: tuple[str, int], what: str, sources: list[str]) -> None:
    have_sources, whats = found.setdefault(port, ([], []))
    have_sources.extend(sources)
    whats.append(what)


def normalize(sources) -> list[str]:
    """"lo" first if present, then IPv4 and IPv6 networks merged and sorted; /32 and /128 as
    bare addresses. nft merges overlapping set elements the same way, so the wish and what
    `nft -j list` returns compare equal. Raises ValueError on a source that is neither."""
    sources = list(sources)
    out = [LOOPBACK] if LOOPBACK in sources else []
    groups: dict[str, list] = {}  # "" = any interface, else "<address> via <interface>"
    for s in sources:
        if s != LOOPBACK:
            address, _, iface = s.partition(VIA)
            groups.setdefault(iface, []).append(ipaddress.ip_network(address, strict=False))
    for iface in sorted(groups):
        suffix = f"{VIA}{iface}" if iface else ""
        for version in (4, 6):
            merged = ipaddress.collapse_addresses(n for n in groups[iface] if n.version == version)
            out += [(str(n.network_address) if n.prefixlen == n.max_prefixlen else str(n))
                    + suffix for n in merged]
    return out


def split_source(source: str) -> tuple[str, str]:
    """("10.99.1.2", "mdwg0") of "10.99.1.2 via mdwg0"; (source, "") of a plain one."""
    address, _, iface = source.partition(VIA)
    return address, iface


# -- nftables ----------------------------------------------------------------------------------

def nft_table(port_list: list[Port], cluster_name: str, local: list[LocalPort] = ()) -> str:
    """`table inet meshdeploy { ... }`: per port, accept loopback and the sources, drop the rest;
    per local port, an output chain drops the connections a local user but the allowed ones
    opens to it. Only a new connection's packets (`ct state new`): a reply sent from the port
    (a client's ephemeral source port can equal it while its rpc-server is down) belongs to
    whoever serves that client. A packet without a socket of a user (the kernel's own resets)
    matches no `meta skuid`."""
    rules = []
    for p in port_list:
        match = f"{p.proto} dport {p.port}"
        if LOOPBACK in p.sources:
            rules.append(f'{match} iifname "{d.network_loopback_ifaces["nft"]}" accept')
        ifaces = sorted({split_source(s)[1] for s in p.sources if s != LOOPBACK})
        for iface in ifaces:
            on = f' iifname "{iface}"' if iface else ""
            for family, version in (("ip", 4), ("ip6", 6)):
                chosen = [a for a, i in map(split_source, p.sources)
                          if i == iface and _version(a) == version]
                if chosen:
                    rules.append(f"{match}{on} {family} saddr {{ {', '.join(chosen)} }} accept")
        rules.append(f'{match} counter drop comment "{comment_text(p.what)}"')
    body = "".join(f"\t\t{r}\n" for r in rules)
    comment = comment_text(f"meshdeploy allow-list, cluster {cluster_name}")
    output = ""
    if local:
        lo = d.network_loopback_ifaces["nft"]
        out_rules = "".join(
            f'\t\ttcp dport {p.port} oifname "{lo}" ct state new meta skuid != '
            f'{{ {", ".join(u.split()[1] for u in p.uids)} }} counter drop '
            f'comment "{comment_text(p.what)}"\n' for p in local)
        output = (f"\tchain {d.network_nft_output_chain} {{\n"
                  "\t\ttype filter hook output priority filter; policy accept;\n"
                  f"{out_rules}\t}}\n")
    return (f"table {TABLE} {{\n"
            f'\tcomment "{comment}"\n'
            f"\tchain {d.network_nft_chain} {{\n"
            "\t\ttype filter hook input priority filter; policy accept;\n"
            f"{body}\t}}\n{output}}}\n")


def nft_file(cluster, host, build_copiers=(), login_uid: int | None = None) -> str:
    """The file for `nft -f`: one transaction that replaces table inet meshdeploy, and only it.

    Creating the table first makes the delete succeed whether or not it existed (nft 1.0.6 has
    no `destroy`); a file that fails to load changes nothing.
    """
    return (f"# meshdeploy: allow-list of {comment_text(host.name)}'s meshdeploy ports. "
            "Generated; the next apply replaces it.\n"
            f"table {TABLE} {{}}\ndelete table {TABLE}\n"
            + nft_table(ports(cluster, host, build_copiers), cluster.name,
                        local_ports(cluster, host, login_uid)))


def _version(source: str) -> int | None:
    return None if source == LOOPBACK else ipaddress.ip_network(source).version


def comment_text(text: str) -> str:
    """Text safe inside an nft comment "..." or a `#` line: no quote, newline or `;` survives."""
    return _COMMENT_UNSAFE.sub("?", text)[:_COMMENT_MAX]


def boot_unit() -> str:
    """The systemd unit that loads the table again at boot, after the host's own nftables.service
    (whose stock /etc/nftables.conf starts with `flush ruleset`)."""
    return render(TEMPLATES / "meshdeploy-nftables.service",
                  file=exec_arg(d.network_nft_file, "network_nft_file"))


def apply_commands(text: str) -> list[str]:
    """Load the table (`nft -f` is atomic) and keep the file for boot only once it loaded, so
    the boot unit never meets a ruleset that fails; then enable that unit for the next boot,
    without the reload `systemctl enable` does by default: nothing starts it now (the table is
    loaded), and a reload reruns every generator and rereads every unit file."""
    unit = f"{d.network_unit_dir}/{d.network_nft_unit}.service"
    staged = f"{d.network_nft_file}.new"
    return [
        shell.write_file(staged, text, "0644"),
        shell.command("nft", "-f", staged, shell.AND, "mv", "-f", staged, d.network_nft_file),
        shell.write_file(unit, boot_unit(), "0644"),
        shell.command("systemctl", "enable", "--no-reload", "--quiet", d.network_nft_unit),
    ]


def remove_commands() -> list[str]:
    """Delete the table (present or not) and what loads it at boot; touches no other table."""
    unit = f"{d.network_unit_dir}/{d.network_nft_unit}.service"
    family, table = d.network_nft_family, d.network_nft_table
    return [
        shell.command("systemctl", "disable", "--now", "--quiet", d.network_nft_unit, shell.QUIET,
                      shell.THEN, "rm", "-f", unit, d.network_nft_file),
        shell.command("nft", "add", "table", family, table, shell.AND,
                      "nft", "delete", "table", family, table),
        # Forget the deleted unit (a oneshot with RemainAfterExit stays loaded until then).
        shell.command("systemctl", "daemon-reload"),
    ]


# -- plan --------------------------------------------------------------------------------------

def diffs(wanted: dict, live: dict | None) -> list[AttrDiff]:
    """One AttrDiff per port whose sources differ (None = not filtered), for `~ network.allowlist`.

    `live` is facts.Allowlist: None (no table) counts as no port filtered.
    """
    live = live or {}
    out = []
    for key in sorted(set(wanted) | set(live), key=key_order):
        before, after = live.get(key), wanted.get(key)
        if before != after:
            name = f"tcp/{key}" if key.isdigit() else key
            out.append(AttrDiff(name, _shown(before), _shown(after)))
    return out


def key_order(key: str):
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def _shown(sources: list[str] | None) -> str | None:
    return None if sources is None else " ".join(sources)
