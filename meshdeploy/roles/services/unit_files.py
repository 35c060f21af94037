"""The service files the services role writes: the systemd units of rpc-server and llama-server
(hardened, with their IP allow-lists) and the macOS LaunchDaemon plist. Pure text from the
cluster file; services.operations (services.orchestrator for llama-server's) decides when each is
written and restarted."""

from __future__ import annotations

import ipaddress
from dataclasses import replace as _replace
from pathlib import Path

from meshdeploy.config.checks import exposed_rpc_servers
from meshdeploy.config.addresses import is_loopback, is_single_address
from meshdeploy.core import registry
from meshdeploy.core.paths import model_path, rpc_server_cache
from meshdeploy.core.units import (
    SystemdExpr,
    comment_value,
    env_line,
    exec_line,
    ip_literals,
    line_value,
    ordered_after,
    plist,
    render,
    unit_name,
)
from meshdeploy.roles.services import argv as argvs
from meshdeploy.roles.services import defaults as d

TEMPLATES = Path(__file__).with_name("templates")


def _render(template: str, **values) -> str:
    return render(TEMPLATES / template, **values)


def _env_lines(env: dict, setting: str) -> str:
    return "".join(env_line(k, v, setting) for k, v in sorted(env.items()))


def _groups(host, present=None) -> str:
    """SupplementaryGroups= of the host's backend; with `present` (the services.Groups fact)
    only the groups that exist there: a missing one keeps the unit from starting."""
    groups = (d.services_gpu_groups.get(host.backend) or "").split()
    if present is not None:
        groups = [g for g in groups if g in present]
    return f"SupplementaryGroups={' '.join(groups)}\n" if groups else ""


def _sandbox(host) -> str:
    """Per-backend lines: the device nodes it opens, and W^X memory where nothing JITs."""
    devices = d.services_device_allow.get(host.backend)
    lines = (["DevicePolicy=closed"] + [f"DeviceAllow={a}" for a in devices] if devices
             else ["PrivateDevices=yes"])
    if host.backend in d.services_deny_write_execute:
        lines.append("MemoryDenyWriteExecute=yes")
    return "".join(line + "\n" for line in lines)


def firewall(peers: list[str], setting: str, why_not: str | None = None) -> str:
    """IPAddressDeny=any plus the peers (enforced by cgroup BPF where the kernel and systemd
    allow it; elsewhere systemd says so in the journal and starts the unit unrestricted)."""
    allow = None if why_not else ip_literals(["localhost", *peers], setting)
    if allow is None:
        why_not = why_not or ("a peer address is a DNS name, which IPAddressAllow= cannot hold: "
                              f"{' '.join(comment_value(p, setting) for p in peers)}")
        return f"# Not IP-restricted: {why_not}.\n"
    return f"IPAddressDeny=any\nIPAddressAllow={allow}\n"


def _rpc_peers(cluster, host, rpc) -> list[str]:
    """Addresses an rpc-server hears from: the hosts whose llama-servers use it (their tunnel
    addresses under network.transport: wireguard; loopback under ssh, where sshd connects), and
    its own bind (the local TCP probe and a llama-server on the same host come from it)."""
    peers = []
    for server in cluster.servers:
        for e in cluster.rpc_endpoints(server):
            if e.host.name != host.name or e.rpc.port != rpc.port:
                continue
            # network.transport: ssh: a forwarded connection comes from the worker's own sshd.
            peers.append("127.0.0.1" if e.via is not None
                         else cluster.source_address(cluster.host(server.host)))
            break
    if not peers:
        return []
    # Prometheus's probes (monitoring.scrapers) where they reach the port: as the network
    # role's allow-list lets them in (not loopback, not inside a WireGuard tunnel).
    reached = not (is_loopback(rpc.bind or "") or cluster.network.tunnel)
    # Single addresses only: a network of scrapers could use the worker (network.rules).
    scrapers = [a for a in registry.admitted(cluster) if is_single_address(a)] if reached else []
    return peers + ([] if rpc.bind == "0.0.0.0" else [rpc.bind]) + scrapers


def _after_tunnel(cluster, needed: bool) -> str:
    """Under network.transport: wireguard, a unit that listens on or dials a tunnel address
    starts after the tunnel: before wg-quick made the interface, that address does not exist
    (rpc-server cannot bind it and exits; llama-server aborts when a worker is unreachable)."""
    if not (needed and cluster.network.tunnel):
        return ""
    return ordered_after(cluster.network.tunnel_unit, "network.wireguard.interface")


def rpc_unit(cluster, host, rpc, build_dir: str, rpc_binary: str, groups=None) -> str:
    """+ groups: the GPU groups that exist on the host (services.Groups); None: not known, every
      group the backend's devices need"""
    where = f"hosts.{host.name}.rpc_servers[{rpc.port}]"
    cache_name = unit_name(rpc.unit_name, where)
    argv, env = argvs.rpc_server_argv(f"{build_dir}/bin/{rpc_binary}", host, rpc,
                                      rpc_server_cache(host.layout, rpc.port))
    warning = ""
    if exposed(cluster, host):
        # Said in the journal at every start, not only at plan time (seed ernos, section 13.4).
        warning = ("ExecStartPre=/bin/echo \"meshdeploy: WARNING: RPC on this port is "
                   "unauthenticated and unencrypted\"\n")
    return _render("rpc-server.service", cluster=comment_value(cluster.name, "cluster"),
                   bind=line_value(rpc.bind, f"{where}.bind"), port=int(rpc.port),
                   exec_start=exec_line(argv, f"{where} (ExecStart)"),
                   environment=_env_lines(env, f"{where} (Environment)"),
                   cache_name=line_value(cache_name, where), groups=_groups(host, groups),
                   tunnel=_after_tunnel(cluster, rpc.bind == cluster.source_address(host)),
                   warning=warning, sandbox=_sandbox(host), firewall=_rpc_firewall(
                       cluster, host, rpc, f"{where} (IPAddressAllow)"))


def exposed(cluster, host) -> bool:
    return any(exposed.host == host.name for exposed in exposed_rpc_servers(cluster))


def _rpc_firewall(cluster, host, rpc, setting: str) -> str:
    peers = _rpc_peers(cluster, host, rpc)
    if not peers:
        return firewall(peers, setting, "no llama-server in this cluster file uses it")
    return firewall(peers, setting)


def _server_firewall(cluster, server, setting: str) -> str:
    """llama-server dials its workers and answers the clients in servers.<name>.allow; a
    non-loopback bind with no such list serves clients nobody listed."""
    try:
        loopback = ipaddress.ip_address(server.bind).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not server.allow:
        return firewall([], setting, f"it serves clients on {comment_value(server.bind, setting)}")
    scrapers = [] if loopback else list(registry.admitted(cluster))  # Prometheus reads its /metrics
    return firewall([e.address for e in cluster.rpc_endpoints(server)] + list(server.allow)
                    + scrapers, setting)


def after_forwards(cluster, host) -> str:
    """network.transport: ssh: llama-server dials its workers through this host's forwards."""
    return "".join(ordered_after(f.unit_name, f"network.transport (forward to {f.worker.name})")
                   for f in cluster.ssh_forwards(host))


def server_unit(cluster, host, server, build_dir: str, flags, model_sha: str | None,
                runs=(), script: str | None = None, groups=None) -> str:
    """llama-server's systemd unit; with runs and script (the md-failover it runs), md-failover
    in its place (roles/services/README.md, "Failover"). groups: as rpc_unit's."""
    where = f"servers.{server.name}"
    api_key = server.api_key_file
    credentials = ""
    if api_key:
        # The service user cannot read the operator's file; systemd hands it a private copy.
        credentials = f"LoadCredential=api-key:{line_value(api_key, f'{where}.api_key_file')}\n"
        server = _with_key_path(server, SystemdExpr("${CREDENTIALS_DIRECTORY}/api-key"))
    if script is not None:
        argv = argvs.failover_argv(d.services_failover_python, script,
                                   f"{build_dir}/bin/llama-server", cluster, server,
                                   model_path(cluster, server.model, host), runs,
                                   frozenset(flags) if flags else None)
    else:
        argv = argvs.llama_server_argv(f"{build_dir}/bin/llama-server", cluster, server,
                                       model_path(cluster, server.model, host),
                                       frozenset(flags) if flags else None)
    env = argvs.device_env(host) | ({"MESHDEPLOY_MODEL_SHA256": model_sha} if model_sha else {})
    return _render("llama-server.service",
                   failover=failover_lines(None if script is None else server.unit_name),
                   cluster=comment_value(cluster.name, "cluster"),
                   name=line_value(unit_name(server.name, where), where),
                   bind=line_value(server.bind, f"{where}.bind"), port=int(server.port),
                   exec_start=exec_line(argv, f"{where} (ExecStart)"),
                   environment=_env_lines(env, f"{where} (Environment)"),
                   credentials=credentials, groups=_groups(host, groups),
                   sandbox=_sandbox(host),
                   tunnel=_after_tunnel(cluster, any(e.host.name != server.host
                                                     for e in cluster.rpc_endpoints(server)))
                   + after_forwards(cluster, host),
                   firewall=_server_firewall(cluster, server, f"{where} (IPAddressAllow)"))


# [Service] settings of llama-server's unit that a copy of it does not take: its command and its
# restart policy (a copy runs once, for a measurement). Its environment is rendered without the
# model's digest, so what is left of it is the devices' (GGML_VK_VISIBLE_DEVICES): the copy sees
# the server's devices. Nor md-failover's runtime folder (named after the unit: a copy that
# ended would remove the running server's state file with it).
_NOT_SANDBOX = frozenset({"Type", "ExecStart", "Restart", "RestartSec", "RuntimeDirectory"})


def server_sandbox(cluster, host, server) -> list[str]:
    """The sandbox of llama-server `server`'s systemd unit as systemd-run properties: every
    [Service] setting of server_unit but its command and restart policy (the user, groups,
    credential, device environment, device and IP rules, system call filters). bench
    --compare-local and --sweep run copies of the server in it."""
    text = server_unit(cluster, host, server, "/nonexistent", None, None)
    service = text.split("\n[Service]\n", 1)[1].split("\n[", 1)[0]
    out = []
    for line in service.splitlines():
        name, eq, value = line.partition("=")
        if not eq or line.startswith("#") or name in _NOT_SANDBOX:
            continue
        if name in ("IPAddressAllow", "IPAddressDeny"):
            # systemd-run (252) takes address prefixes only: the unit file's word `localhost`
            # is what systemd means by it.
            value = " ".join("127.0.0.0/8 ::1" if w == "localhost" else w
                             for w in value.split())
        out.append(f"{name}={value}")
    return out


def launchd_plist(label: str, argv: list[str], env: dict, log_dir: str) -> str:
    """A LaunchDaemon: kept alive like Restart=always, logs where `log show` cannot lose them."""
    doc = {"Label": label, "ProgramArguments": list(argv), "RunAtLoad": True,
           "KeepAlive": True, "ThrottleInterval": 3, "UserName": "nobody",
           "StandardOutPath": f"{log_dir}/{label}.log", "StandardErrorPath": f"{log_dir}/{label}.log"}
    if env:
        doc["EnvironmentVariables"] = dict(sorted(env.items()))
    return plist(doc, label)


def failover_lines(runtime: str | None) -> str:
    """What md-failover needs of a unit beyond llama-server's: pidfd_getfd (to watch
    llama-server's connections; not in @system-service) and, for a system unit, its state file's
    folder (RuntimeDirectory=, named after the unit)."""
    if runtime is None:
        return ""
    return (f"SystemCallFilter={d.services_failover_syscall}\n"
            + (f"RuntimeDirectory={runtime}\n" if runtime else ""))


def _with_key_path(server, path):
    return _replace(server, api_key_file=path)
