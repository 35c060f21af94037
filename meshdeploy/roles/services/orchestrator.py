"""services.llama_server[name]: the orchestrator's unit, run bare or under md-failover, restarted
after its workers, then healthy.

What the step weighs: the placements rpc_cache planned (the -ts values, md-failover's runs, the
layout), the model's sha256 as the models role resolved it, and why a running llama-server must
restart (its workers or forwards restarted in this run, or workers restarted since that hold no
connection from it). Then its /health wait (health_wait). md-failover (templates/md-failover.py)
is written beside the unit, named by its content (failover_script), and run under the host's
python3. The units themselves are unit_files.py's, their command lines argv.py's; writing a
unit and (re)starting it once is operations.py's.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace as _replace

from meshdeploy.config.sources import HfResolved
from meshdeploy.core import progress, shell
from meshdeploy.core.context import HostContext, Step
from meshdeploy.core.paths import model_path
from meshdeploy.core.units import unit_name
from meshdeploy.roles.services import argv as argvs
from meshdeploy.roles.services import defaults as d
from meshdeploy.roles.services import failover, rootless
from meshdeploy.roles.services.managers import Launchd, Runit, Systemd, SystemdUser
from meshdeploy.roles.services.operations import (
    GROUPS,
    ROLE,
    TEMPLATES,
    _awaits_build,
    _build_info,
    _unit_step,
    manager,
    tcp_wait,
)
from meshdeploy.roles.services.unit_files import (
    after_forwards,
    failover_lines,
    launchd_plist,
    server_unit,
)

# The roles whose run values the services read (Resolved.value): the models as the hub
# resolved them, the placements (-ts, md-failover's runs, layouts).
MODELS, RPC_CACHE = "models", "rpc_cache"
FAILOVER = TEMPLATES / "md-failover.py"


def failover_script(prefix: str) -> str:
    """Where md-failover lives on a host: named by its content, so a unit that runs another
    version of it reads as changed."""
    sha = hashlib.sha256(FAILOVER.read_bytes()).hexdigest()[:12]
    return f"{prefix}/tools/{d.services_failover_script}-{sha}.py"


def _python(ctx, mgr) -> str:
    """The python3 md-failover runs under, by absolute path (systemd, launchd and runit's run
    scripts all name their program so): on runit the RunitTools fact's, else beside its sh."""
    if isinstance(mgr, Launchd):
        return d.services_failover_launchd_python
    if isinstance(mgr, Runit):
        tools = ctx.fact("services.RunitTools") or {}
        if tools.get("python3"):
            return tools["python3"]
        sh = tools.get("sh") or "/bin/sh"
        return sh.rsplit("/", 1)[0] + "/python3"
    return d.services_failover_python


def model_sha(ctx: HostContext, name: str) -> str | None:
    resolved = ctx.resolved.value(MODELS, "models", {}).get(name)
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


def _workers_outside_run(ctx: HostContext, server) -> list[str]:
    """The hosts of the server's rpc-servers this run did not probe (--limit), file order."""
    if ctx.cluster_facts is None:  # a deploy calling the operation alone: no run to compare
        return []
    hosts = dict.fromkeys(e.host.name for e in ctx.cluster.rpc_endpoints(server))
    return [h for h in hosts if h != ctx.host.name and h not in ctx.cluster_facts]


def llama_server(ctx: HostContext, name: str) -> Step:
    """services.llama_server[name]: the orchestrator, restarted after its workers, then healthy."""
    resource = f"llama_server[{name}]"
    server = next((s for s in ctx.servers() if s.name == name), None)
    if server is None:
        return Step(ctx.change(ROLE, resource, "no-op", "not served from this host"))
    outside = _workers_outside_run(ctx, server)
    if outside:
        # A run that leaves a worker out (--limit: it is away) knows neither its memory nor
        # whether it answers: the placements, the --rpc list and md-failover's are not
        # decided here, and a unit written now would drop the failover that keeps the
        # server answering without it. Left as it runs.
        return Step(ctx.change(ROLE, resource, "no-op",
                               f"{', '.join(outside)} not in this run (--limit): left as it is, "
                               "failover included; apply without --limit to change it"))
    runs = ctx.resolved.value(RPC_CACHE, "failover", {}).get(name) or ()
    # md-failover runs a server that may lose workers, where the plan knows its placements.
    script = failover_script(ctx.prefix) if runs and ctx.cluster.supervised(server) else None
    supervised_as = server
    split = ctx.resolved.value(RPC_CACHE, "splits", {}).get(name)
    if runs:  # the full placement: placement: auto's or the file's -ts, idle workers left off
        full = runs[0]
        server = _replace(server, rpc=full.rpc,
                          tensor_split="auto" if full.split is None else full.split)
    elif split is not None:  # placement: auto's split (roles.rpc_cache), written as -ts
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
        if script is not None:
            argv = argvs.failover_argv(
                _python(ctx, mgr), script, f"{build_dir}/bin/llama-server", ctx.cluster,
                supervised_as, model_path(ctx.cluster, server.model, ctx.host), runs,
                frozenset(flags) if flags else None,
                # macOS has no /run: a launchd job keeps no state file.
                state=None if isinstance(mgr, Launchd) else
                failover.state_path(ctx.host, server))
        else:
            argv = argvs.llama_server_argv(f"{build_dir}/bin/llama-server", ctx.cluster, server,
                                           model_path(ctx.cluster, server.model, ctx.host),
                                           frozenset(flags) if flags else None)
        env = argvs.device_env(ctx.host) | ({"MESHDEPLOY_MODEL_SHA256": sha} if sha else {})
    if isinstance(mgr, Launchd):
        want = launchd_plist(unit, argv, env, d.services_launchd_log_dir)
    elif isinstance(mgr, (SystemdUser, Runit)):
        where = f"servers.{server.name}"
        want = rootless.want(ctx, mgr, where, argv, env,
                              f"llama-server {server.name} on {server.bind}:{server.port} "
                              "(meshdeploy)", "llama-server.user.service",
                              name=unit_name(server.name, where), bind=server.bind,
                              port=int(server.port),
                              after=after_forwards(ctx.cluster, ctx.host),
                              failover=failover_lines("" if script else None),
                              writable=(failover.folder(ctx.host, server),) if script
                              else ())
    else:
        want = server_unit(ctx.cluster, ctx.host, supervised_as if script else server,
                           build_dir, manifest.get("flags"), sha, runs, script,
                           groups=ctx.fact(GROUPS))
    step, restarted = _unit_step(ctx, resource, unit, want, reason)
    if script is not None and step.commands:
        # The unit names the script by its content: written before the unit that runs it.
        step.commands = [shell.write_file(script, FAILOVER.read_text())] + step.commands
        if ctx.host.rootless:  # its folder, which the unit's sandbox lets it write
            step.commands.insert(0, rootless.make_cache(failover.folder(ctx.host, server)))
    if restarted:
        # Stopped first: its RPC connections close, so each worker accepts the check at once.
        # e.port: the port it dials (the forward's loopback port under network.transport: ssh).
        # md-failover asks the workers itself and starts without one that is away: no check
        # (a failed one would leave the unit stopped).
        checks = [] if script else [
            tcp_wait(e.address, e.port, 10, None, f"{ctx.host.name} -> {e.target}")
            for e in endpoints]
        step.commands = ([mgr.stop(unit)] if checks else []) + checks + step.commands + [
            health_wait(server, mgr.journal(unit), rootless.restarts_shim(mgr))]
        lost = sorted({e.host.name for e in endpoints} & ctx.failed_hosts)
        if lost and script is None:
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
    layouts = ctx.resolved.value(RPC_CACHE, "layouts", ())
    layout = next((lay for lay in layouts if lay.server == server_name), None)
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
