"""services: systemd units for rpc-server and llama-server, restarted once when they changed."""

from __future__ import annotations

import difflib
import ipaddress
from dataclasses import replace as _replace
from pathlib import Path

from meshdeploy.config.checks import exposed_rpc_servers
from meshdeploy.config.model import RUNIT, HfResolved, rpc_ref
from meshdeploy.core import progress, shell
from meshdeploy.core.context import HostContext, Step, Teardown
from meshdeploy.core.paths import installed_build, model_path, rpc_server_cache
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.probe import Section
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
from meshdeploy.errors import PlanError
from meshdeploy.roles.services import argv as argvs
from meshdeploy.roles.services import defaults as d
from meshdeploy.roles.services import rootless
from meshdeploy.roles.services.facts import KeyFile, RpcClients, Rtt, RunitTools, Units
from meshdeploy.roles.services.managers import (  # noqa: F401 - Systemd/Launchd named here too
    Launchd,
    Runit,
    Systemd,
    SystemdUser,
    for_layout,
)

ROLE = "services"
TEMPLATES = Path(__file__).with_name("templates")


def sections(cluster, host) -> list[Section]:
    layout = host.layout
    if layout is not None and layout.rootless:
        out = [Section("services.Units", Units,
                       {"services": layout.services, "manager": layout.manager})]
        if layout.manager == RUNIT:
            out.append(Section("services.RunitTools", RunitTools))
    else:
        out = [Section("services.Units", Units)]
    for server in (s for s in cluster.servers if s.host == host.name and s.api_key_file):
        if host.rootless:
            out.append(Section(f"services.KeyFile[{server.name}]", KeyFile,
                               {"path": server.api_key_file, "reader": True}))
        else:
            out.append(Section(f"services.KeyFile[{server.name}]", KeyFile,
                               {"path": server.api_key_file}, privileged=True))
    targets = rtt_targets(cluster, host)
    if targets:
        out.append(Section("services.Rtt", Rtt, {"targets": targets}))
    if host.rpc_servers:
        out.append(Section("services.RpcClients", RpcClients,
                           {"ports": tuple(r.port for r in host.rpc_servers)}))
    return out


def preflight(ctx: HostContext) -> None:
    """Refuse an API key file that is missing or that anyone but root can read: systemd reads
    it as root (LoadCredential=) and hands the service a private copy, so nothing else needs
    it. meshdeploy does not fix the mode itself: a key others could read may have leaked, and
    the key is the operator's to replace. A rootless host: llama-server reads it as the login
    user, who must own it alone (rootless.check_key_file); a runit host needs sh and svlogd."""
    layout = ctx.host.layout
    if layout is not None and layout.manager == RUNIT and (ctx.host.rpc_servers or ctx.servers()):
        tools = ctx.fact("services.RunitTools") or {}
        missing = [t for t in ("sh", "svlogd") if not tools.get(t)]
        if missing:
            raise PlanError(f"host {ctx.host.name}: runit's services need {' and '.join(missing)} "
                            "on the login user's PATH, as a plain absolute path",
                            hint="Termux: pkg install termux-services; elsewhere install runit")
    if is_macos(ctx):
        return  # launchd: llama-server reads the file itself (services README)
    for server in ctx.servers():
        path = server.api_key_file
        fact = ctx.fact(f"services.KeyFile[{server.name}]") if path else None
        if fact is None:
            continue
        if ctx.host.rootless:
            rootless.check_key_file(ctx, server, fact)
            continue
        where = f"servers.{server.name}.api_key_file {path} on host {ctx.host.name}"
        quoted = shell.quote(path)
        if not fact["exists"]:
            raise PlanError(f"{where} does not exist",
                            hint=f"create it, readable by root only, with the key on one line: "
                                 f"sudo install -m 600 -o root -g root /dev/null {quoted}; "
                                 "then write the key into it")
        loose = fact["mode"] & 0o077
        if loose or fact["uid"] != 0:
            raise PlanError(f"{where} is mode {fact['mode']:04o}, owned by {fact['owner']}: "
                            "only root may read it",
                            hint=f"sudo chown root:root {quoted} && sudo chmod 600 {quoted}" +
                                 ("; others could read it: replace the key if it may have "
                                  "leaked" if loose else ""))


def rtt_targets(cluster, host) -> list[str]:
    """SSH ports of the other hosts this host's llama-servers use as workers."""
    targets = []
    for server in (s for s in cluster.servers if s.host == host.name):
        for e in cluster.rpc_endpoints(server):
            target = e.ssh_target
            if e.host.name != host.name and target not in targets:
                targets.append(target)
    return targets


def _render(template: str, **values) -> str:
    return render(TEMPLATES / template, **values)


def _env_lines(env: dict, setting: str) -> str:
    return "".join(env_line(k, v, setting) for k, v in sorted(env.items()))


def _groups(host) -> str:
    groups = d.services_gpu_groups.get(host.backend)
    return f"SupplementaryGroups={groups}\n" if groups else ""


def _sandbox(host) -> str:
    """Per-backend lines: the device nodes it opens, and W^X memory where nothing JITs."""
    devices = d.services_device_allow.get(host.backend)
    lines = (["DevicePolicy=closed"] + [f"DeviceAllow={a}" for a in devices] if devices
             else ["PrivateDevices=yes"])
    if host.backend in d.services_deny_write_execute:
        lines.append("MemoryDenyWriteExecute=yes")
    return "".join(line + "\n" for line in lines)


def _firewall(peers: list[str], setting: str, why_not: str | None = None) -> str:
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
    return peers + ([] if rpc.bind == "0.0.0.0" else [rpc.bind])


def _after_tunnel(cluster, needed: bool) -> str:
    """Under network.transport: wireguard, a unit that listens on or dials a tunnel address
    starts after the tunnel: before wg-quick made the interface, that address does not exist
    (rpc-server cannot bind it and exits; llama-server aborts when a worker is unreachable)."""
    if not (needed and cluster.network.tunnel):
        return ""
    return ordered_after(cluster.network.wireguard.unit, "network.wireguard.interface")


def rpc_unit(cluster, host, rpc, build_dir: str, rpc_binary: str) -> str:
    where = f"hosts.{host.name}.rpc_servers[{rpc.port}]"
    cache_name = unit_name(rpc.unit_name, where)
    argv, env = argvs.rpc_server_argv(f"{build_dir}/bin/{rpc_binary}", host, rpc,
                                      rpc_server_cache(host.layout, rpc.port))
    warning = ""
    if _exposed(cluster, host):
        # Said in the journal at every start, not only at plan time (seed ernos, section 13.4).
        warning = ("ExecStartPre=/bin/echo \"meshdeploy: WARNING: RPC on this port is "
                   "unauthenticated and unencrypted\"\n")
    return _render("rpc-server.service", cluster=comment_value(cluster.name, "cluster"),
                   bind=line_value(rpc.bind, f"{where}.bind"), port=int(rpc.port),
                   exec_start=exec_line(argv, f"{where} (ExecStart)"),
                   environment=_env_lines(env, f"{where} (Environment)"),
                   cache_name=line_value(cache_name, where), groups=_groups(host),
                   tunnel=_after_tunnel(cluster, rpc.bind == cluster.source_address(host)),
                   warning=warning, sandbox=_sandbox(host), firewall=_rpc_firewall(
                       cluster, host, rpc, f"{where} (IPAddressAllow)"))


def _exposed(cluster, host) -> bool:
    return any(exposed.host == host.name for exposed in exposed_rpc_servers(cluster))


def _rpc_firewall(cluster, host, rpc, setting: str) -> str:
    peers = _rpc_peers(cluster, host, rpc)
    if not peers:
        return _firewall(peers, setting, "no llama-server in this cluster file uses it")
    return _firewall(peers, setting)


def _server_firewall(cluster, server, setting: str) -> str:
    """llama-server dials its workers and answers the clients in servers.<name>.allow; a
    non-loopback bind with no such list serves clients nobody listed."""
    try:
        loopback = ipaddress.ip_address(server.bind).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not server.allow:
        return _firewall([], setting, f"it serves clients on {comment_value(server.bind, setting)}")
    return _firewall([e.address for e in cluster.rpc_endpoints(server)] + list(server.allow),
                     setting)


def _after_forwards(cluster, host) -> str:
    """network.transport: ssh: llama-server dials its workers through this host's forwards."""
    return "".join(ordered_after(f.unit_name, f"network.transport (forward to {f.worker.name})")
                   for f in cluster.ssh_forwards(host))


def server_unit(cluster, host, server, build_dir: str, flags, model_sha: str | None) -> str:
    where = f"servers.{server.name}"
    api_key = server.api_key_file
    credentials = ""
    if api_key:
        # The service user cannot read the operator's file; systemd hands it a private copy.
        credentials = f"LoadCredential=api-key:{line_value(api_key, f'{where}.api_key_file')}\n"
        server = _with_key_path(server, SystemdExpr("${CREDENTIALS_DIRECTORY}/api-key"))
    argv = argvs.llama_server_argv(f"{build_dir}/bin/llama-server", cluster, server,
                                   model_path(cluster, server.model, host),
                                   frozenset(flags) if flags else None)
    env = {"MESHDEPLOY_MODEL_SHA256": model_sha} if model_sha else {}
    return _render("llama-server.service", cluster=comment_value(cluster.name, "cluster"),
                   name=line_value(unit_name(server.name, where), where),
                   bind=line_value(server.bind, f"{where}.bind"), port=int(server.port),
                   exec_start=exec_line(argv, f"{where} (ExecStart)"),
                   environment=_env_lines(env, f"{where} (Environment)"),
                   credentials=credentials, groups=_groups(host), sandbox=_sandbox(host),
                   tunnel=_after_tunnel(cluster, any(e.host.name != server.host
                                                     for e in cluster.rpc_endpoints(server)))
                   + _after_forwards(cluster, host),
                   firewall=_server_firewall(cluster, server, f"{where} (IPAddressAllow)"))


def is_macos(ctx) -> bool:
    return (ctx.fact("toolchain.Platform") or {}).get("kernel") == "Darwin"


def launchd_plist(label: str, argv: list[str], env: dict, log_dir: str) -> str:
    """A LaunchDaemon: kept alive like Restart=always, logs where `log show` cannot lose them."""
    doc = {"Label": label, "ProgramArguments": list(argv), "RunAtLoad": True,
           "KeepAlive": True, "ThrottleInterval": 3, "UserName": "nobody",
           "StandardOutPath": f"{log_dir}/{label}.log", "StandardErrorPath": f"{log_dir}/{label}.log"}
    if env:
        doc["EnvironmentVariables"] = dict(sorted(env.items()))
    return plist(doc, label)


def _with_key_path(server, path):
    return _replace(server, api_key_file=path)


def manager(ctx) -> Systemd:
    """The host's service manager: a rootless host's own (Layout.manager) first, else the
    system's (launchd when the Platform fact says Darwin)."""
    rootless = for_layout(ctx.host.layout, ctx.fact("services.RunitTools"), ctx.cluster.name)
    if rootless is not None:
        return rootless
    return Launchd() if is_macos(ctx) else Systemd()


def _unit_step(ctx, resource, unit, want, reason_restart=None):
    """Write the unit when it differs, then (re)start it once; returns (step, restarted)."""
    mgr = manager(ctx)
    units = ctx.fact("services.Units") or {}
    have = units.get(unit)
    write = [*mgr.write(unit, want), mgr.install(unit)]
    if have is None:
        return Step(ctx.change(ROLE, resource, "create", "new service",
                               unit_diff=_diff(None, want, mgr.label(unit))),
                    [*mgr.write(unit, want), mgr.start_new(unit)]), True
    if mgr.differs(have, want, unit):
        return Step(ctx.change(ROLE, resource, "update", "unit file differs; restart",
                               unit_diff=_diff(have["content"], want, mgr.label(unit))),
                    write), True
    if reason_restart:
        return Step(ctx.change(ROLE, resource, "update", reason_restart,
                               [AttrDiff("restart", None, "yes")]),
                    [mgr.restart(unit)]), True
    if have["active"] == "active" and have.get("started") and have.get("written") and \
            have["written"] > have["started"]:
        # Written, never restarted: the process still runs the unit's previous binary or model.
        return Step(ctx.change(ROLE, resource, "update",
                               "unit file written after the running process started "
                               "(an earlier apply stopped before the restart)",
                               [AttrDiff("restart", None, "yes")]),
                    [mgr.install(unit)]), True
    if have["active"] != "active" or have["enabled"] != "enabled":
        return Step(ctx.change(ROLE, resource, "update",
                               f"{have['active']}/{have['enabled']}: start it",
                               [AttrDiff("state", f"{have['active']}/{have['enabled']}",
                                         "active/enabled")]),
                    [mgr.restart(unit)]), True
    return Step(ctx.change(ROLE, resource, "no-op", f"{unit} active, unit unchanged")), False


def _diff(before, after, label) -> str:
    a = (before or "").splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, after.splitlines(keepends=True),
                                        f"{label} (host)", f"{label} (wanted)"))


def _build_info(ctx) -> tuple[str | None, dict | None]:
    """(folder, manifest) of the build this host's services run; the manifest when that build
    is installed already (re-read after a new build: the resources' rereads)."""
    key = ctx.build.key if ctx.build else None
    if key is None:
        return None, None
    builds = (ctx.fact("llama_cpp.Builds") or {}).get("builds", {})
    return installed_build(ctx.prefix, key), builds.get(key)


# "$1" seconds, "$2" address, "$3" port: values arrive as arguments of a fixed bash script.
# Each attempt is bounded: a SYN that a firewall drops, or that a full accept queue drops,
# is never answered, and bash's /dev/tcp would wait out the kernel's whole SYN retry budget.
# Tried every 0.2 s: an rpc-server listens a fraction of a second after its restart, and a
# refused connect costs next to nothing.
_TCP_WAIT = ('end=$((SECONDS + $1)); while :; do '
             'timeout 3 bash -c \'exec 3<>"/dev/tcp/$0/$1"\' "$2" "$3" 2>/dev/null && exit 0; '
             '[ "$SECONDS" -lt "$end" ] || exit 1; sleep 0.2; done')


def tcp_wait(address: str, port: int, seconds: int, journal: str | None, who: str) -> str:
    """Readiness by TCP connect: rpc-server exits 0 even when it could not bind (LAB_NOTES).

    rpc-server serves one client at a time and listens with a backlog of 1: while a
    llama-server holds its connection, probes wait in the accept queue, and once it is full
    further SYNs are dropped. So an orchestrator's workers are checked only after its
    llama-server is stopped (see llama_server), when each rpc-server accepts at once."""
    fail = (shell.command("echo", f"{who}: nothing accepts TCP on {address}:{port} after "
                                  f"{seconds} s", shell.TO_STDERR)
            + "; " + (journal + "; " if journal else "") + "exit 1")
    return (shell.command("bash", "-c", _TCP_WAIT, "tcp-wait", int(seconds), address, int(port))
            + f" || {{ {fail}; }}")


def _awaits_build(ctx, resource: str, unit: str, restarts: tuple[str, ...] = ()) -> Step:
    """A unit whose binary is the build this run makes: its ExecStart is known after apply."""
    have = (ctx.fact("services.Units") or {}).get(unit)
    return Step(ctx.change(ROLE, resource, "create" if have is None else "update",
                           "runs the new build",
                           [AttrDiff("exec_start", None, None, known_after_apply=True)]),
                restarts=restarts)


def rpc_server(ctx: HostContext, port: int) -> Step:
    """services.rpc_server[port]: one rpc-server unit, proven listening by a TCP probe."""
    resource = f"rpc_server[{port}]"
    rpc = ctx.host.rpc_server(port)
    if rpc is None:
        return Step(ctx.change(ROLE, resource, "no-op", "no rpc-server on this port here"))
    build_dir, manifest = _build_info(ctx)
    mgr = manager(ctx)
    unit = mgr.name(rpc.unit_name)
    if manifest is None:
        return _awaits_build(ctx, resource, unit, restarts=(rpc_ref(ctx.host.name, port),))
    cache = rpc_server_cache(ctx.host.layout, rpc.port)
    if isinstance(mgr, (Launchd, SystemdUser, Runit)):
        argv, env = argvs.rpc_server_argv(f"{build_dir}/bin/{manifest['rpc_binary']}", ctx.host,
                                          rpc, cache)
    if isinstance(mgr, Launchd):
        want = launchd_plist(unit, argv, env, d.services_launchd_log_dir)
    elif isinstance(mgr, (SystemdUser, Runit)):
        want = rootless.want(ctx, mgr, f"hosts.{ctx.host.name}.rpc_servers[{port}]", argv, env,
                              f"llama.cpp RPC worker {rpc.bind}:{port} (meshdeploy)",
                              "rpc-server.user.service",
                              exposed=_exposed(ctx.cluster, ctx.host), bind=rpc.bind,
                              port=int(port))
    else:
        want = rpc_unit(ctx.cluster, ctx.host, rpc, build_dir, manifest["rpc_binary"])
    step, restarted = _unit_step(ctx, resource, unit, want)
    if restarted:
        if ctx.host.rootless and rpc.cache:
            step.commands.insert(0, rootless.make_cache(cache))
        step.restarts = (rpc_ref(ctx.host.name, port),)
        step.commands.append(tcp_wait(rpc.bind, port, d.services_rpc_probe_seconds,
                                      mgr.journal(unit), f"{ctx.host.name}/{unit}"))
    return step


def stale_units(ctx: HostContext) -> Step:
    """services.cleanup: meshdeploy units the cluster file no longer describes."""
    mgr = manager(ctx)
    wanted = {mgr.name(r.unit_name) for r in ctx.host.rpc_servers}
    wanted |= {mgr.name(s.unit_name) for s in ctx.servers()}
    wanted |= {mgr.name(f.unit_name) for f in ctx.cluster.ssh_forwards(ctx.host)}
    units = ctx.fact("services.Units") or {}
    stale = sorted(u for u in units if u not in wanted)
    if not stale:
        return Step(ctx.change(ROLE, "cleanup", "no-op", "no stale units"))
    cmds = [mgr.remove(u) for u in stale] + mgr.reload()
    return Step(ctx.change(ROLE, "cleanup", "delete", "no longer in the cluster file",
                           [AttrDiff("units", " ".join(stale), None)]), cmds)


def model_sha(ctx: HostContext, name: str) -> str | None:
    resolved = ctx.resolved.models.get(name)
    if isinstance(resolved, HfResolved):
        return resolved.files[0].sha256
    return None


def health_wait(server, journal: str | None = None, shim: str = "") -> str:
    """llama-server answers 503 while loading; 200 on /health means ready.

    + shim: fixed shell text before the script (rootless.restarts_shim: how a rootless host's manager
      counts restarts)"""
    h = server.health
    prelude = progress.REPORT + ("\n" + shim if shim else "")
    return (shell.template(TEMPLATES / "health.sh", prelude=prelude,
                           RETRIES=int(h.retries), INTERVAL=f"{h.interval:g}",
                           URL=f"{server.local_url}/health", UNIT=server.unit_name,
                           BUDGET=f"{h.budget:g}", EXITS=d.services_health_exits)
            + "\n" + (journal or Systemd().journal(server.unit_name)) + "; exit 1")


def llama_server(ctx: HostContext, name: str) -> Step:
    """services.llama_server[name]: the orchestrator, restarted after its workers, then healthy."""
    resource = f"llama_server[{name}]"
    server = next((s for s in ctx.servers() if s.name == name), None)
    if server is None:
        return Step(ctx.change(ROLE, resource, "no-op", "not served from this host"))
    split = ctx.resolved.splits.get(name)
    if split is not None:  # placement: auto's split (roles.rpc_cache), written as -ts
        server = _replace(server, tensor_split=tuple(float(v) for v in split))
    endpoints = ctx.cluster.rpc_endpoints(server)
    moved = [e.target for e in endpoints if e.ref in ctx.steps.restarted()]
    reason = f"workers restart ({', '.join(moved)})" if moved else None
    forwards = _restarted_forwards(ctx, endpoints)
    if forwards and not reason:
        # Its connections through the forward closed: it aborted, or will at its next request.
        reason = f"forwards restart ({', '.join(forwards)})"
    build_dir, manifest = _build_info(ctx)
    mgr = manager(ctx)
    unit = mgr.name(server.unit_name)
    dropped = _dropped(ctx, name, unit, endpoints)
    if dropped and not reason:
        reason = f"workers restarted after it hold no connection from it ({', '.join(dropped)})"
    if manifest is None:
        return _awaits_build(ctx, resource, unit)
    sha = model_sha(ctx, server.model)
    if isinstance(mgr, (Launchd, SystemdUser, Runit)):
        flags = manifest.get("flags")
        argv = argvs.llama_server_argv(f"{build_dir}/bin/llama-server", ctx.cluster, server,
                                       model_path(ctx.cluster, server.model, ctx.host),
                                       frozenset(flags) if flags else None)
        env = {"MESHDEPLOY_MODEL_SHA256": sha} if sha else {}
    if isinstance(mgr, Launchd):
        want = launchd_plist(unit, argv, env, d.services_launchd_log_dir)
    elif isinstance(mgr, (SystemdUser, Runit)):
        where = f"servers.{server.name}"
        want = rootless.want(ctx, mgr, where, argv, env,
                              f"llama-server {server.name} on {server.bind}:{server.port} "
                              "(meshdeploy)", "llama-server.user.service",
                              name=unit_name(server.name, where), bind=server.bind,
                              port=int(server.port),
                              after=_after_forwards(ctx.cluster, ctx.host))
    else:
        want = server_unit(ctx.cluster, ctx.host, server, build_dir, manifest.get("flags"), sha)
    step, restarted = _unit_step(ctx, resource, unit, want, reason)
    if restarted:
        # Stopped first: its RPC connections close, so each worker accepts the check at once.
        # e.port: the port it dials (the forward's loopback port under network.transport: ssh).
        checks = [tcp_wait(e.address, e.port, 10, None, f"{ctx.host.name} -> {e.target}")
                  for e in endpoints]
        step.commands = ([mgr.stop(unit)] if checks else []) + checks + step.commands + [
            health_wait(server, mgr.journal(unit), rootless.restarts_shim(mgr))]
        lost = sorted({e.host.name for e in endpoints} & ctx.failed_hosts)
        if lost:
            # Restarting now would stop a llama-server that still serves and start one that
            # aborts on the missing worker: it stays as it is until the worker is back.
            step.commands = [shell.command(
                "echo", f"{ctx.host.name}: llama-server {name} left as it was: its worker "
                f"host(s) {', '.join(lost)} failed in this run; bring it back, then apply again",
                shell.TO_STDERR) + "; exit 1"]
    return step


def _dropped(ctx, server_name: str, unit: str, endpoints) -> list[str]:
    """The workers (host:port) restarted after this running llama-server, whose connection to
    the process before is closed: the rpc-server listens with no client (services.RpcClients)
    and its process started later than the llama-server's (each by its own host's clock, as
    services.Units reads them). Both, because a llama-server also holds no connection while it
    loads, or where it freed its buffers. Only workers the placement gives weights (rpc_cache's
    layout); none without a layout, nor where a host could not say."""
    have = (ctx.fact("services.Units") or {}).get(unit)
    layout = next((lay for lay in ctx.resolved.layouts if lay.server == server_name), None)
    if have is None or have["active"] != "active" or not have.get("started") or layout is None:
        return []
    used = {(row["host"], row["port"]) for row in layout.rows if row["used"]}
    out = []
    for e in endpoints:
        facts = (ctx.cluster_facts or {}).get(e.host.name)
        if (e.host.name, e.rpc.port) not in used or facts is None:
            continue
        port = (facts.get("services.RpcClients") or {}).get(str(e.rpc.port))
        worker = manager(HostContext(ctx.cluster, e.host, facts, ctx.resolved)).name(
            e.rpc.unit_name)
        started = ((facts.get("services.Units") or {}).get(worker) or {}).get("started")
        if port is not None and port["listening"] and not port["peers"] and started \
                and started > have["started"]:
            out.append(e.ref)
    return out


def _restarted_forwards(ctx, endpoints) -> list[str]:
    """Unit names of this host's forwards to the server's workers that this run (re)starts."""
    steps = ctx.steps.on(ctx.host.name)
    out = []
    for e in endpoints:
        step = steps.get(f"services.ssh_forward[{e.host.name}]")
        name = f"meshdeploy-ssh-{e.host.name}"
        if e.via is not None and step is not None and step.commands and name not in out:
            out.append(name)
    return out


def _unit_resource(unit: str) -> str:
    """The resource address of a unit this role owns: meshdeploy-rpc-50052 -> rpc_server[50052],
    meshdeploy-server-main -> llama_server[main], meshdeploy-ssh-node2 -> ssh_forward[node2]
    (com.meshdeploy.* on macOS alike)."""
    short = unit.removeprefix(d.services_unit_prefix).removeprefix(d.services_launchd_prefix)
    kind, _, rest = short.partition("-")
    return {"rpc": f"rpc_server[{rest}]", "server": f"llama_server[{rest}]",
            "ssh": f"ssh_forward[{rest}]"}.get(kind, f"unit[{unit}]")


def destroy(ctx: HostContext, purge: bool) -> Teardown:
    """Every rpc-server, llama-server and forward unit of meshdeploy on the host: stopped, disabled and
    deleted (the Units fact lists exactly meshdeploy's own)."""
    mgr = manager(ctx)
    units = ctx.fact("services.Units") or {}
    steps = []
    for unit in sorted(units):
        have = units[unit]
        # A llama-server whose workers stop first ends "failed": reset, so systemd forgets it.
        cmds = [mgr.remove(unit)] + mgr.forget(unit)
        steps.append(Step(ctx.change(ROLE, _unit_resource(unit), "delete",
                                     "leaves the cluster: stopped, disabled, removed",
                                     [AttrDiff("unit", unit, None),
                                      AttrDiff("state", f"{have.get('active')}/"
                                                        f"{have.get('enabled')}", None)]), cmds))
    return Teardown(tuple(steps))
