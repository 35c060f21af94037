"""services: systemd units for rpc-server and llama-server, restarted once when they changed."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from string import Template

from meshdeploy.deploy.context import HostContext, Step, q, write_file_command
from meshdeploy.deploy.plan import AttrDiff
from meshdeploy.deploy.probe import Section
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.models import operations as models
from meshdeploy.roles.models.hf import HfResolved
from meshdeploy.roles.services import argv as argvs
from meshdeploy.roles.services import defaults as d
from meshdeploy.roles.services.facts import Units

ROLE = "services"
TEMPLATES = Path(__file__).with_name("templates")
_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def sections(cluster, host) -> list[Section]:
    return [Section("services.Units", Units)]


def systemd_quote(arg: str) -> str:
    if _PLAIN.match(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_line(argv: list[str]) -> str:
    return " ".join(systemd_quote(a) for a in argv)


def _render(template: str, **values) -> str:
    return Template((TEMPLATES / template).read_text()).substitute(values)


def _env_lines(env: dict) -> str:
    return "".join(f"Environment={systemd_quote(f'{k}={v}')}\n" for k, v in sorted(env.items()))


def _groups(host) -> str:
    groups = d.services_gpu_groups.get(host.backend)
    return f"SupplementaryGroups={groups}\n" if groups else ""


def rpc_unit(cluster, host, rpc, build_dir: str, rpc_binary: str) -> str:
    cache_name = f"meshdeploy-rpc-{rpc.port}"
    argv, env = argvs.rpc_server_argv(f"{build_dir}/bin/{rpc_binary}", host, rpc,
                                      f"/var/cache/{cache_name}")
    warning = ""
    if any(w.startswith(f"rpc-server on {host.name} ") for w in argvs.warnings_for(cluster)):
        # Said in the journal at every start, not only at plan time (seed ernos, section 13.4).
        warning = ("ExecStartPre=/bin/echo \"meshdeploy: WARNING: RPC on this port is "
                   "unauthenticated and unencrypted\"\n")
    return _render("rpc-server.service", cluster=cluster.name, bind=rpc.bind, port=rpc.port,
                   exec_start=exec_line(argv), environment=_env_lines(env),
                   cache_name=cache_name, groups=_groups(host), warning=warning)


def server_unit(cluster, host, server, build_dir: str, flags, model_sha: str | None) -> str:
    api_key = server.api_key_file
    credentials = ""
    if api_key:
        # The service user cannot read the operator's file; systemd hands it a private copy.
        credentials = f"LoadCredential=api-key:{api_key}\n"
        server = _with_key_path(server, "${CREDENTIALS_DIRECTORY}/api-key")
    argv = argvs.llama_server_argv(f"{build_dir}/bin/llama-server", cluster, server,
                                   models.model_path(cluster, server.model),
                                   frozenset(flags) if flags else None)
    env = {"MESHDEPLOY_MODEL_SHA256": model_sha} if model_sha else {}
    return _render("llama-server.service", cluster=cluster.name, name=server.name,
                   bind=server.bind, port=server.port, exec_start=exec_line(argv),
                   environment=_env_lines(env), credentials=credentials, groups=_groups(host))


def _with_key_path(server, path):
    from dataclasses import replace

    return replace(server, api_key_file=path)


def unit_path(name: str) -> str:
    return f"{d.services_unit_dir}/{name}.service"


def journal_tail(unit: str) -> str:
    return (f"journalctl -u {unit} -n {d.services_journal_lines} --no-pager -o cat >&2 "
            "2>/dev/null || true")


def _unit_step(ctx, resource, unit, want, reason_restart=None):
    """Write the unit when it differs, then (re)start it once; returns (step, restarted)."""
    units = ctx.fact("services.Units") or {}
    have = units.get(unit)
    write = [write_file_command(unit_path(unit), want),
             f"systemctl daemon-reload && systemctl enable --quiet {unit} && systemctl restart {unit}"]
    if have is None:
        return Step(ctx.change(ROLE, resource, "create", "new service",
                               unit_diff=_diff(None, want, unit)), write), True
    if have["content"] != want:
        return Step(ctx.change(ROLE, resource, "update", "unit file differs; restart",
                               unit_diff=_diff(have["content"], want, unit)), write), True
    if reason_restart:
        return Step(ctx.change(ROLE, resource, "update", reason_restart,
                               [AttrDiff("restart", None, "yes")]),
                    [f"systemctl restart {unit}"]), True
    if have["active"] != "active" or have["enabled"] != "enabled":
        return Step(ctx.change(ROLE, resource, "update",
                               f"{have['active']}/{have['enabled']}: start it",
                               [AttrDiff("state", f"{have['active']}/{have['enabled']}",
                                         "active/enabled")]),
                    [f"systemctl enable --quiet {unit} && systemctl restart {unit}"]), True
    return Step(ctx.change(ROLE, resource, "no-op", f"{unit} active, unit unchanged")), False


def _diff(before, after, unit) -> str:
    a = (before or "").splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, after.splitlines(keepends=True),
                                        f"{unit}.service (host)", f"{unit}.service (wanted)"))


def _build_info(ctx) -> tuple[str | None, dict | None]:
    key = ctx.run.get("build_key")
    if key is None:
        return None, None
    return f"{ctx.prefix}/{llama_cpp.d.llama_cpp_builds_dir}/{key}", llama_cpp.manifest_for(ctx)


def tcp_wait(address: str, port: int, seconds: int, unit: str | None, who: str) -> str:
    """Readiness by TCP connect: rpc-server exits 0 even when it could not bind (LAB_NOTES)."""
    fail = (f"echo \"{who}: nothing accepts TCP on {address}:{port} after {seconds} s\" >&2; "
            + (journal_tail(unit) + "; " if unit else "") + "exit 1")
    return (f"bash -c 'for i in $(seq {seconds}); do (exec 3<>/dev/tcp/{address}/{port}) "
            f"2>/dev/null && exit 0; sleep 1; done; exit 1' || {{ {fail}; }}")


def rpc_server(ctx: HostContext, port: int) -> Step:
    """services.rpc_server[port]: one rpc-server unit, proven listening by a TCP probe."""
    resource = f"rpc_server[{port}]"
    rpc = ctx.host.rpc_server(port)
    if rpc is None:
        return Step(ctx.change(ROLE, resource, "no-op", "no rpc-server on this port here"))
    build_dir, manifest = _build_info(ctx)
    unit = rpc.unit_name
    if manifest is None:
        ctx.run.setdefault("restarted", set()).add(unit)
        ctx.resolved.restarted.add(f"{ctx.host.name}:{port}")
        have = (ctx.fact("services.Units") or {}).get(unit)
        return Step(ctx.change(ROLE, resource, "create" if have is None else "update",
                               "runs the new build",
                               [AttrDiff("exec_start", None, None, known_after_apply=True)]),
                    deferred=True)
    want = rpc_unit(ctx.cluster, ctx.host, rpc, build_dir, manifest["rpc_binary"])
    step, restarted = _unit_step(ctx, resource, unit, want)
    if restarted:
        ctx.resolved.restarted.add(f"{ctx.host.name}:{port}")
        step.commands.append(tcp_wait(rpc.bind, port, d.services_rpc_probe_seconds, unit,
                                      f"{ctx.host.name}/{unit}"))
    return step


def stale_units(ctx: HostContext) -> Step:
    """services.cleanup: meshdeploy units the cluster file no longer describes."""
    wanted = {r.unit_name for r in ctx.host.rpc_servers} | {s.unit_name for s in ctx.servers()}
    units = ctx.fact("services.Units") or {}
    stale = sorted(u for u in units if u not in wanted)
    if not stale:
        return Step(ctx.change(ROLE, "cleanup", "no-op", "no stale units"))
    cmds = [f"systemctl disable --now {u} 2>/dev/null; rm -f {q(unit_path(u))}" for u in stale]
    cmds.append("systemctl daemon-reload")
    return Step(ctx.change(ROLE, "cleanup", "delete", "no longer in the cluster file",
                           [AttrDiff("units", " ".join(stale), None)]), cmds)


def model_sha(ctx: HostContext, name: str) -> str | None:
    resolved = ctx.resolved.models.get(name)
    if isinstance(resolved, HfResolved):
        return resolved.files[0].sha256
    return None


def health_wait(server) -> str:
    """llama-server answers 503 while loading; 200 on /health means ready."""
    h = server.health
    host = "127.0.0.1" if server.bind in ("0.0.0.0", "127.0.0.1") else server.bind
    url = f"http://{host}:{server.port}/health"
    return (f"for i in $(seq {h.retries}); do c=$(curl -s -o /dev/null -w '%{{http_code}}' "
            f"--max-time 5 {url}); [ \"$c\" = 200 ] && exit 0; sleep {h.interval:g}; done; "
            f"echo \"{server.unit_name}: /health not 200 after {h.budget:g} s (last: $c)\" >&2; "
            f"{journal_tail(server.unit_name)}; exit 1")


def llama_server(ctx: HostContext, name: str) -> Step:
    """services.llama_server[name]: the orchestrator, restarted after its workers, then healthy."""
    resource = f"llama_server[{name}]"
    server = next((s for s in ctx.servers() if s.name == name), None)
    if server is None:
        return Step(ctx.change(ROLE, resource, "no-op", "not served from this host"))
    endpoints = ctx.cluster.rpc_endpoints(server)
    moved = [e.target for e in endpoints
             if f"{e.host.name}:{e.rpc.port}" in ctx.resolved.restarted]
    reason = f"workers restart ({', '.join(moved)})" if moved else None
    build_dir, manifest = _build_info(ctx)
    if manifest is None:
        have = (ctx.fact("services.Units") or {}).get(server.unit_name)
        return Step(ctx.change(ROLE, resource, "create" if have is None else "update",
                               "runs the new build",
                               [AttrDiff("exec_start", None, None, known_after_apply=True)]),
                    deferred=True)
    want = server_unit(ctx.cluster, ctx.host, server, build_dir, manifest.get("flags"),
                       model_sha(ctx, server.model))
    step, restarted = _unit_step(ctx, resource, server.unit_name, want, reason)
    if restarted:
        checks = [tcp_wait(e.address, e.rpc.port, 10, None, f"{ctx.host.name} -> {e.target}")
                  for e in endpoints]
        step.commands = checks + step.commands + [health_wait(server)]
    return step
