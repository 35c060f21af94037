"""services: systemd units for rpc-server and llama-server, restarted once when they changed.

Here: what the probe asks of a host (sections) and what preflight refuses, the service manager
of a host, writing a unit when it differs and (re)starting it once (_unit_step, shared with the
forwards), the readiness checks (tcp_wait, port_owner), the rpc-server step, the cleanup of
stale units and destroy. The llama-server step, md-failover's script included, is
orchestrator.py's.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from meshdeploy.config.model import RUNIT, SYSTEMD_USER, rpc_ref
from meshdeploy.core import shell
from meshdeploy.core.context import HostContext, Step, Teardown
from meshdeploy.core.paths import installed_build, rpc_server_cache
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.probe import Section
from meshdeploy.errors import PlanError
from meshdeploy.roles.services import argv as argvs
from meshdeploy.roles.services import defaults as d
from meshdeploy.roles.services import failover
from meshdeploy.roles.services import rootless
from meshdeploy.roles.services.facts import (
    Groups,
    KeyFile,
    RpcClients,
    Rtt,
    RunitTools,
    Units,
    UserNamespaces,
)
from meshdeploy.roles.services.managers import (  # noqa: F401 - Systemd/Launchd named here too
    Launchd,
    Runit,
    Systemd,
    SystemdUser,
    for_layout,
)
from meshdeploy.roles.services.unit_files import exposed, launchd_plist, rpc_unit

ROLE = "services"
TEMPLATES = Path(__file__).with_name("templates")
GROUPS = "services.Groups"  # the GPU groups that exist on a system host (SupplementaryGroups=)


def sections(cluster, host) -> list[Section]:
    layout = host.layout
    if layout is not None and layout.rootless:
        out = [Section("services.Units", Units,
                       {"services": layout.services, "manager": layout.manager})]
        if layout.manager == RUNIT:
            out.append(Section("services.RunitTools", RunitTools))
        if layout.manager == SYSTEMD_USER:
            out.append(Section(rootless.USERNS, UserNamespaces))
    else:
        out = [Section("services.Units", Units)]
        wanted = d.services_gpu_groups.get(host.backend)
        if wanted:
            out.append(Section(GROUPS, Groups, {"names": tuple(wanted.split())}))
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


def is_macos(ctx) -> bool:
    return (ctx.fact("toolchain.Platform") or {}).get("kernel") == "Darwin"


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


def port_owner(mgr, unit: str, who: str, what: str, ports) -> str | None:
    """After tcp_wait: every listener on each of `ports` is the unit's own
    (templates/port-owner.sh), not another local user's that took the port while the unit was
    down. systemd: the whole path of the unit's cgroup (/system.slice/UNIT.service; under
    systemd --user the path its manager names); runit: the login user's uid. None under launchd
    (no ss, no cgroups)."""
    if isinstance(mgr, Launchd):
        return None
    mode = ("uid" if isinstance(mgr, Runit) else "user" if isinstance(mgr, SystemdUser)
            else "cgroup")
    return shell.template(TEMPLATES / "port-owner.sh", args=[int(p) for p in ports], WHO=who,
                          WHAT=what, MODE=mode, UNIT=f"{unit}.service",
                          WANT=f"/system.slice/{unit}.service" if mode == "cgroup" else "")


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
                              exposed=exposed(ctx.cluster, ctx.host), bind=rpc.bind,
                              port=int(port), writable=[cache] if rpc.cache else [])
    else:
        want = rpc_unit(ctx.cluster, ctx.host, rpc, build_dir, manifest["rpc_binary"],
                        groups=ctx.fact(GROUPS))
    step, restarted = _unit_step(ctx, resource, unit, want)
    if restarted:
        if ctx.host.rootless and rpc.cache:
            step.commands.insert(0, rootless.make_cache(cache))
        step.restarts = (rpc_ref(ctx.host.name, port),)
        step.commands.append(tcp_wait(rpc.bind, port, d.services_rpc_probe_seconds,
                                      mgr.journal(unit), f"{ctx.host.name}/{unit}"))
        # rpc-server exits 0 when it cannot bind: whoever took the port first would pass the
        # wait, and be sent the tensors (through the forwards under network.transport: ssh).
        owner = port_owner(mgr, unit, f"{ctx.host.name}/{unit}", "the rpc-server", [port])
        if owner:
            step.commands.append(owner)
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
    servers_gone = [u for u in stale if _unit_resource(u).startswith("llama_server[")]
    for u in servers_gone:  # a server moved off a rootless host: md-failover's folder goes too
        cmds += failover.remove_folder(ctx.host, u)
    if servers_gone and not list(ctx.servers()):
        # The last server left this host: md-failover's script with it (servers share it).
        cmds.append(_failover_scripts_removed(ctx))
    return Step(ctx.change(ROLE, "cleanup", "delete", "no longer in the cluster file",
                           [AttrDiff("units", " ".join(stale), None)]), cmds)


def _unit_resource(unit: str) -> str:
    """The resource address of a unit this role owns: meshdeploy-rpc-50052 -> rpc_server[50052],
    meshdeploy-server-main -> llama_server[main], meshdeploy-ssh-node2 -> ssh_forward[node2]
    (com.meshdeploy.* on macOS alike)."""
    short = unit.removeprefix(d.services_unit_prefix).removeprefix(d.services_launchd_prefix)
    kind, _, rest = short.partition("-")
    return {"rpc": f"rpc_server[{rest}]", "server": f"llama_server[{rest}]",
            "ssh": f"ssh_forward[{rest}]"}.get(kind, f"unit[{unit}]")


def _failover_scripts_removed(ctx: HostContext) -> str:
    """md-failover's scripts in the host's tools folder removed, and the folder once empty
    (the folder arrives as $0, the name's pattern is fixed text)."""
    return shell.command("sh", "-c", f'rm -f -- "$0"/{d.services_failover_script}-*.py; '
                         'rmdir -- "$0" 2>/dev/null; true', f"{ctx.prefix}/tools")


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
        if _unit_resource(unit).startswith("llama_server["):
            # md-failover, the program a server's unit may run, goes with the unit (the folder
            # arrives as $0, the name's pattern is fixed text).
            cmds.append(_failover_scripts_removed(ctx))
            cmds += failover.remove_folder(ctx.host, unit)
        steps.append(Step(ctx.change(ROLE, _unit_resource(unit), "delete",
                                     "leaves the cluster: stopped, disabled, removed",
                                     [AttrDiff("unit", unit, None),
                                      AttrDiff("state", f"{have.get('active')}/"
                                                        f"{have.get('enabled')}", None)]), cmds))
    return Teardown(tuple(steps))
