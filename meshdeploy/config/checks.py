"""Checks on a schema-valid cluster that JSON Schema cannot express, made on the typed model.

Each one exists because the cluster would otherwise fail later, on a host, with a worse message:
two rpc-servers fighting over one device crash (seed split-guide), an unreachable --rpc entry
aborts llama-server at start, an rpc-server serves one client at a time.

The checks read meshdeploy.config.model objects; the Document turns a data path back into
file:line:col. Two things the model resolves away are read from the file as written: whether
an rpc-server's bind and a server's rpc list are given (the message points at them, or at
their owner), and a Hugging Face source's file versus files (the model keeps one tuple).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from meshdeploy.config import distribution
from meshdeploy.config.document import Document
from meshdeploy.config.addresses import WILDCARD, is_loopback, is_private
from meshdeploy.config.model import CPU_DEVICE, Cluster, Host, parse_rpc_ref, reachable_from
from meshdeploy.config.sources import HfSource
from meshdeploy.config.schema import suggest
from meshdeploy.config.yaml_doc import render_path
from meshdeploy.errors import ConfigIssue

# ggml-rpc.h: llama-server connects to at most this many rpc-servers.
MAX_RPC_SERVERS = 16

DOTTED_NUMBERS = re.compile(r"[0-9.]+")


def check(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    """Every problem of `cluster` (built from `doc`), in file order."""
    issues: list[ConfigIssue] = []
    for checker in (check_models, check_hosts, check_local, check_rootless,
                    check_ports, check_servers):
        issues += checker(doc, cluster)
    issues.sort(key=lambda i: (i.line, i.col))
    return issues


def check_models(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    issues = []
    for name, model in cluster.models.items():
        if not isinstance(model.source, HfSource):
            continue
        path = ("models", name, "huggingface")
        # HfSource.files holds either key: which one the file gives is read from the file.
        file, files = doc.written(path + ("file",)), doc.written(path + ("files",))
        if bool(file) == bool(files):
            both = "both file and files" if file else "neither file nor files"
            issues.append(doc.issue(path, f"has {both}",
                                    "give file for one GGUF, or files for the parts of a "
                                    "split GGUF", at_key=True))
        elif files and model.source.sha256:
            issues.append(doc.issue(path + ("sha256",), "sha256 applies to a single file",
                                    "remove it for split models: each part is checked "
                                    "against the hub's LFS hash"))
    return issues


def check_hosts(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    issues = []
    for host in cluster.hosts:
        name, hpath = host.name, ("hosts", host.name)
        address = host.address
        if DOTTED_NUMBERS.fullmatch(address):
            try:
                ipaddress.IPv4Address(address)
            except ValueError:
                issues.append(doc.issue(hpath + ("address",),
                                        f"'{address}' is not a valid IPv4 address"))
        if host.vulkan_visible and host.backend != "vulkan":
            issues.append(doc.issue(
                hpath + ("vulkan_visible_devices",),
                f"is read only on a vulkan host; host {name} is {host.backend}",
                f"set hosts.{name}.backend to vulkan, or remove vulkan_visible_devices"))
        elif host.vulkan_visible:
            beyond = [dev for dev in host.devices if dev.startswith("Vulkan")
                      and dev[6:].isdigit() and int(dev[6:]) >= len(host.vulkan_visible)]
            if beyond:
                issues.append(doc.issue(
                    hpath + ("devices",),
                    f"names {', '.join(beyond)}, but vulkan_visible_devices makes only "
                    f"{len(host.vulkan_visible)} Vulkan device(s) visible",
                    "Vulkan<i> is the i-th index of vulkan_visible_devices: list one index "
                    "for each device, or remove the devices (they follow from the list)"))
        devices = host.devices
        claimed: list[tuple[set[str], int]] = []
        for i, rpc in enumerate(host.rpc_servers):
            rpath = hpath + ("rpc_servers", i)
            device = rpc.device
            if device is not None and device != CPU_DEVICE and device not in devices:
                known = ", ".join(devices + (CPU_DEVICE,))
                issues.append(doc.issue(
                    rpath + ("device",),
                    f"'{device}' is not a device of host {name} ({host.backend}: {known})",
                    suggest(device, list(devices) + [CPU_DEVICE], "devices") +
                    f" (list the host's devices under hosts.{name}.devices)"))
            mine = set(host.rpc_devices(rpc))
            for other, j in claimed:
                if mine & other:
                    shared = ", ".join(sorted(mine & other))
                    issues.append(doc.issue(
                        rpath + ("device",),
                        f"shares device {shared} with hosts.{name}.rpc_servers[{j}]",
                        "give each rpc-server on one host its own device (-d): two with "
                        "the default both claim every device and crash"))
                    break
            claimed.append((mine, i))
            bind = rpc.bind
            if bind is None:
                issues.append(doc.issue(
                    rpath, f"needs an explicit bind: address '{address}' is a DNS name and "
                           "rpc-server -H takes IPv4 literals only",
                    "set bind to the host's IPv4 address on the cluster network", at_key=True))
            elif not is_private(bind) and not cluster.network.allow_public:
                given = bool(doc.written(rpath + ("bind",)))
                issues.append(doc.issue(
                    rpath + ("bind",) if given else rpath,
                    f"binds {bind}, which is not a private or loopback address",
                    "rpc-server is unauthenticated and unencrypted: bind a private "
                    "address, or set network.allow_public: true to accept the risk",
                    at_key=not given))
    return issues


def check_local(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    """`connection: local` is the machine meshdeploy runs on: no SSH settings apply to it, and
    only one host can be that machine (two would be one machine planned twice)."""
    issues = []
    local = [h for h in cluster.hosts if h.local]
    for host in local:
        if doc.written(("hosts", host.name, "ssh")) is not None:
            issues.append(doc.issue(
                ("hosts", host.name, "ssh"),
                f"host {host.name} has connection: local, which runs its commands on this "
                "machine without SSH: ssh settings do not apply to it",
                "remove the ssh block (sudo is used when meshdeploy does not run as root), or "
                "drop connection: local to reach the host over SSH", at_key=True))
    for host in local[1:]:
        issues.append(doc.issue(
            ("hosts", host.name, "connection"),
            f"host {host.name} is local too, but {local[0].name} already is: only one host "
            "can be the machine meshdeploy runs on",
            f"reach {host.name} over SSH (remove connection: local), or merge the two hosts"))
    return issues


def check_rootless(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    """A rootless host gets no sudo (the network role's checks refuse a firewall or a tunnel
    there), so a file that asks for it on such a host is refused where it asks."""
    issues = []
    for host in cluster.hosts:
        path = ("hosts", host.name)
        if not host.rootless:
            if host.unprotected:
                issues.append(doc.issue(
                    path + ("unprotected",),
                    f"host {host.name} is not rootless: its ports are guarded by the "
                    "allow-list, or network.firewall is off for every host",
                    "remove unprotected (it acknowledges a rootless host's open ports)"))
            continue
        if host.local:
            issues.append(doc.issue(
                path + ("rootless",),
                f"host {host.name} is the machine meshdeploy runs on (connection: local), which "
                "meshdeploy reaches as this process's user, through sudo when that is not root",
                f"reach {host.name} over SSH as the user without root, or remove rootless"))
        if doc.written(path + ("ssh", "sudo")) is True:
            issues.append(doc.issue(
                path + ("ssh", "sudo"),
                f"host {host.name} is rootless: nothing runs through sudo there",
                "remove ssh.sudo, or remove rootless if the user may use sudo"))
    return issues


def check_ports(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    """One listener per (host, port), whether rpc-server, llama-server, a forward's end or
    md-share (md-share and the forwards' reverse ends claimed first, then the rpc-servers, then
    the forwards' own ports: a llama-server on one of them is the one told to move). A forward's
    port that an rpc-server, md-share or a reverse end holds is the network role's check, said
    at the setting the forwards' ports follow from."""
    issues = []
    owners = distribution.derived_ports(cluster)

    def claim(host: str, port: int, path: tuple) -> None:
        owner = owners.setdefault((host, port), render_path(path[:-1]))
        if owner != render_path(path[:-1]):
            issues.append(doc.issue(path, f"port {port} on host {host} is already used by "
                                          f"{owner}", "pick a free port"))

    for host in cluster.hosts:
        for i, rpc in enumerate(host.rpc_servers):
            claim(host.name, rpc.port, ("hosts", host.name, "rpc_servers", i, "port"))
        try:
            forwards = cluster.ssh_forwards(host)
        except KeyError:  # an rpc entry names an unknown host: check_servers says so
            forwards = []
        for forward in forwards:
            for local, _ in forward.ports:
                owners.setdefault((host.name, local), f"the forward to {forward.worker.name}")
    names = {host.name for host in cluster.hosts}
    for server in cluster.servers:
        if server.host in names:
            claim(server.host, server.port, ("servers", server.name, "port"))
    return issues


def check_servers(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    issues = []
    hosts = {host.name: host for host in cluster.hosts}
    served: dict[str, str] = {}
    used_by: dict[str, str] = {}
    for server in cluster.servers:
        name, spath = server.name, ("servers", server.name)
        if server.health.budget < 1:
            issues.append(doc.issue(spath + ("health",),
                                    f"waits only {server.health.budget:g} s for /health",
                                    "allow at least 1 s (retries x interval); large models "
                                    "take minutes", at_key=True))
        if server.model not in cluster.models:
            issues.append(doc.issue(spath + ("model",), f"unknown model '{server.model}'",
                                    suggest(server.model, list(cluster.models), "models")))
        elif server.model in served:
            issues.append(doc.issue(spath + ("model",),
                                    f"model '{server.model}' is already served by "
                                    f"servers.{served[server.model]}",
                                    "serve each model from one orchestrator"))
        else:
            served[server.model] = name
        if not is_loopback(server.bind) and server.api_key_file is None \
                and not server.allow_unauthenticated:
            issues.append(doc.issue(
                spath + ("bind",), f"listens on {server.bind} without an API key: anyone "
                f"who reaches port {server.port} can use the model",
                f"set servers.{name}.api_key_file to a root-only key file on host "
                f"{server.host}, bind 127.0.0.1, or set servers.{name}.allow_unauthenticated: "
                "true to accept the risk"))
        if server.host not in hosts:
            issues.append(doc.issue(spath + ("host",), f"unknown host '{server.host}'",
                                    suggest(server.host, list(hosts), "hosts")))
            continue
        refs = server.rpc or ()
        # `rpc: []` (or no rpc) means every rpc-server: messages then point at the key.
        listed = bool(doc.written(spath + ("rpc",)))
        bad_ref = False
        if len(refs) > MAX_RPC_SERVERS:
            issues.append(doc.issue(
                spath + ("rpc",), f"uses {len(refs)} rpc-servers; llama.cpp accepts at most "
                f"{MAX_RPC_SERVERS} (GGML_RPC_MAX_SERVERS)",
                "list at most 16 in servers.<name>.rpc, or put several devices behind one "
                "rpc-server", at_key=not listed))
        for i, ref in enumerate(refs):
            where = spath + ("rpc", i) if listed else spath + ("rpc",)
            problem = rpc_ref_problem(hosts, ref, server.host, cluster.network.forwarded)
            if problem:
                issues.append(doc.issue(where, *problem))
                bad_ref = True
                continue
            if ref in used_by:
                issues.append(doc.issue(
                    where, f"rpc-server {ref} is already used by servers.{used_by[ref]}",
                    "an rpc-server serves one client at a time: give each server its own "
                    "rpc-servers with an explicit rpc list", at_key=not listed))
            used_by.setdefault(ref, name)
        issues += _allow_issues(doc, server)
        split = server.tensor_split
        if server.placement == "auto" and split != "auto":
            issues.append(doc.issue(
                spath + ("placement",), "is auto, which chooses the split itself, but "
                "tensor_split is set too", "remove tensor_split, or set placement: memory to "
                "keep the split written", at_key=True))
        elif server.placement == "auto" and server.placement_set and not bad_ref and \
                count_devices(hosts, refs, hosts[server.host]) == 0:
            issues.append(doc.issue(
                spath + ("placement",), "is auto, but the server has no devices to split across",
                "remove placement, or give the server rpc-servers or a host with accelerators",
                at_key=True))
        if split != "auto" and not bad_ref:
            tpath = spath + ("tensor_split",)
            wanted = count_devices(hosts, refs, hosts[server.host])
            if wanted == 0:
                issues.append(doc.issue(
                    tpath, "is set, but the server has no devices to split across",
                    "remove tensor_split, or give the server rpc-servers or a host with "
                    "accelerators", at_key=True))
            elif len(split) != wanted:
                issues.append(doc.issue(
                    tpath, f"has {len(split)} values for {wanted} devices",
                    "one value per device: each rpc-server's devices in --rpc order, then "
                    f"the local devices of host {server.host}", at_key=True))
            elif not any(split):
                issues.append(doc.issue(tpath, "all values are 0",
                                        "give at least one device a share", at_key=True))
    return issues


def _allow_issues(doc: Document, server) -> list[ConfigIssue]:
    """servers.<name>.allow: each item an IP address or a network with no host bits set."""
    issues = []
    for i, value in enumerate(server.allow):
        where = ("servers", server.name, "allow", i)
        try:
            ipaddress.ip_network(value, strict=True)
        except ValueError:
            try:
                loose = ipaddress.ip_network(value, strict=False)
            except ValueError:
                issues.append(doc.issue(where, f"{value!r} is not an IP address or network",
                                        "write an address (10.0.0.5) or a network "
                                        "(10.0.0.0/24, ::/0); host names are not allowed"))
            else:
                issues.append(doc.issue(where, f"{value!r} has host bits set",
                                        f"did you mean {loose}?"))
    return issues


def count_devices(hosts: dict[str, Host], refs: tuple[str, ...], local: Host) -> int:
    """How many values -ts takes (Cluster.server_devices, before addresses are known)."""
    total = 0
    for ref in refs:
        name, port = parse_rpc_ref(ref)
        host = hosts[name]
        total += len(host.rpc_devices(host.rpc_server(port)))
    return total + len(local.devices)


def rpc_ref_problem(hosts: dict[str, Host], ref: str, from_host: str,
                    forwarded: bool = False) -> tuple[str, str] | None:
    """What is wrong with `ref` in from_host's --rpc list; under network.transport: ssh
    (forwarded) a loopback bind is reached through the forward."""
    name, port = parse_rpc_ref(ref)
    if name not in hosts:
        return f"unknown host '{name}' in '{ref}'", suggest(name, list(hosts), "hosts")
    host = hosts[name]
    rpc = host.rpc_server(port)
    if rpc is None:
        ports = ", ".join(str(r.port) for r in host.rpc_servers) or "none"
        return (f"host {name} has no rpc-server on port {ref.rpartition(':')[2]}",
                f"rpc-server ports on {name}: {ports}")
    if rpc.bind is not None and not forwarded and not reachable_from(host, rpc.bind, from_host):
        return (f"rpc-server {ref} listens on {rpc.bind}, unreachable from host {from_host}",
                "bind it to an address other hosts can reach, or run the server on "
                f"host {name}")
    return None


@dataclass(frozen=True)
class ExposedRpc:
    """An rpc-server bound to an address outside loopback and the private ranges: allowed, but
    said every time (`warning`), and by its units in the journal at each start."""

    host: str  # host name
    port: int
    bind: str

    @property
    def warning(self) -> str:
        scope = "every interface" if self.bind == WILDCARD else self.bind
        return (f"rpc-server on {self.host} binds {scope} (port {self.port}): RPC is "
                "unauthenticated and unencrypted; anyone who reaches it can run code on "
                "its devices. Restrict it with a firewall or a private network.")


def exposed_rpc_servers(cluster: Cluster) -> list[ExposedRpc]:
    """Every rpc-server of the file that binds beyond loopback and the private ranges."""
    return [ExposedRpc(host.name, rpc.port, rpc.bind) for host, rpc in cluster.rpc_servers()
            if not is_loopback(rpc.bind) and not is_private(rpc.bind)]


def warnings_for(cluster: Cluster) -> list[str]:
    """Risks that are allowed but must be said every time (validate, plan and apply print
    them, with the roles' own: core.loading.warnings; the rpc-server unit says the first kind
    in the journal at each start)."""
    warnings = [exposed.warning for exposed in exposed_rpc_servers(cluster)]
    for host in cluster.hosts:
        if host.unprotected and host.rpc_servers:
            ports = ", ".join(str(r.port) for r in host.rpc_servers)
            warnings.append(
                f"host {host.name} is rootless and unprotected: no allow-list guards its "
                f"rpc-server port(s) {ports}; anything that reaches {host.address} can use them, "
                "unauthenticated and unencrypted.")
        for server in cluster.servers:
            if host.unprotected and server.host == host.name and not is_loopback(server.bind):
                warnings.append(
                    f"host {host.name} is rootless and unprotected: no allow-list guards "
                    f"llama-server {server.name} on {server.bind}:{server.port}; only its API "
                    "key (if any) stands between it and anything that reaches the host.")
    for server in cluster.servers:
        if not is_loopback(server.bind) and server.api_key_file is None:
            warnings.append(
                f"llama-server {server.name} on {server.host} listens on {server.bind}:"
                f"{server.port} without an API key (allow_unauthenticated: true); anyone who "
                f"reaches the port can use the model. Set servers.{server.name}.api_key_file "
                "or bind 127.0.0.1.")
        if cluster.network.firewall and not is_loopback(server.bind) and not server.allow:
            warnings.append(
                f"llama-server {server.name} on {server.host} listens on {server.bind}:"
                f"{server.port}, but servers.{server.name}.allow is empty: the host's "
                "allow-list lets only the host itself connect. List the clients' addresses "
                "or networks there.")
    return warnings
