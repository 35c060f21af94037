"""services: systemd units for rpc-server and llama-server, restarted once when they changed."""

from __future__ import annotations

import difflib
import plistlib
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
from meshdeploy.roles.services.facts import Rtt, Units

ROLE = "services"
TEMPLATES = Path(__file__).with_name("templates")
_PLAIN = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def sections(cluster, host) -> list[Section]:
    out = [Section("services.Units", Units)]
    targets = rtt_targets(cluster, host)
    if targets:
        out.append(Section("services.Rtt", Rtt, {"targets": targets}))
    return out


def rtt_targets(cluster, host) -> list[str]:
    """SSH ports of the other hosts this host's llama-servers use as workers."""
    targets = []
    for server in (s for s in cluster.servers if s.host == host.name):
        for e in cluster.rpc_endpoints(server):
            target = f"{e.address}:{e.host.ssh.port}"
            if e.host.name != host.name and target not in targets:
                targets.append(target)
    return targets


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


def is_macos(ctx) -> bool:
    return (ctx.fact("toolchain.Platform") or {}).get("kernel") == "Darwin"


def launchd_plist(label: str, argv: list[str], env: dict, log_dir: str) -> str:
    """A LaunchDaemon: kept alive like Restart=always, logs where `log show` cannot lose them."""
    doc = {"Label": label, "ProgramArguments": list(argv), "RunAtLoad": True,
           "KeepAlive": True, "ThrottleInterval": 3, "UserName": "nobody",
           "StandardOutPath": f"{log_dir}/{label}.log", "StandardErrorPath": f"{log_dir}/{label}.log"}
    if env:
        doc["EnvironmentVariables"] = dict(sorted(env.items()))
    return plistlib.dumps(doc, sort_keys=True).decode()


def _with_key_path(server, path):
    from dataclasses import replace

    return replace(server, api_key_file=path)


class Systemd:
    """Where units live and how they are (re)started on systemd hosts."""

    def name(self, unit: str) -> str:
        return unit

    def path(self, unit: str) -> str:
        return f"{d.services_unit_dir}/{unit}.service"

    def install(self, unit: str) -> str:
        return f"systemctl daemon-reload && systemctl enable --quiet {unit} && systemctl restart {unit}"

    def restart(self, unit: str) -> str:
        return f"systemctl enable --quiet {unit} && systemctl restart {unit}"

    def remove(self, unit: str) -> str:
        return f"systemctl disable --now {unit} 2>/dev/null; rm -f {q(self.path(unit))}"

    def journal(self, unit: str) -> str:
        return (f"journalctl -u {unit} -n {d.services_journal_lines} --no-pager -o cat >&2 "
                "2>/dev/null || true")


class Launchd(Systemd):
    """The same on macOS: LaunchDaemon plists, launchctl bootstrap/kickstart."""

    def name(self, unit: str) -> str:
        return d.services_launchd_prefix + unit.removeprefix(d.services_unit_prefix)

    def path(self, unit: str) -> str:
        return f"{d.services_launchd_dir}/{unit}.plist"

    def install(self, unit: str) -> str:
        return (f"mkdir -p {d.services_launchd_log_dir} && "
                f"(launchctl bootout system/{unit} 2>/dev/null; true) && "
                f"launchctl bootstrap system {q(self.path(unit))}")

    def restart(self, unit: str) -> str:
        return (f"launchctl kickstart -k system/{unit} 2>/dev/null || "
                f"launchctl bootstrap system {q(self.path(unit))}")

    def remove(self, unit: str) -> str:
        return f"launchctl bootout system/{unit} 2>/dev/null; rm -f {q(self.path(unit))}"

    def journal(self, unit: str) -> str:
        return (f"tail -n {d.services_journal_lines} {d.services_launchd_log_dir}/{unit}.log >&2 "
                "2>/dev/null || true")


def manager(ctx) -> Systemd:
    return Launchd() if is_macos(ctx) else Systemd()


def unit_path(name: str) -> str:
    return Systemd().path(name)


def journal_tail(unit: str) -> str:
    return Systemd().journal(unit)


def _unit_step(ctx, resource, unit, want, reason_restart=None):
    """Write the unit when it differs, then (re)start it once; returns (step, restarted)."""
    mgr = manager(ctx)
    units = ctx.fact("services.Units") or {}
    have = units.get(unit)
    write = [write_file_command(mgr.path(unit), want), mgr.install(unit)]
    if have is None:
        return Step(ctx.change(ROLE, resource, "create", "new service",
                               unit_diff=_diff(None, want, unit)), write), True
    if have["content"] != want:
        return Step(ctx.change(ROLE, resource, "update", "unit file differs; restart",
                               unit_diff=_diff(have["content"], want, unit)), write), True
    if reason_restart:
        return Step(ctx.change(ROLE, resource, "update", reason_restart,
                               [AttrDiff("restart", None, "yes")]),
                    [mgr.restart(unit)]), True
    if have["active"] != "active" or have["enabled"] != "enabled":
        return Step(ctx.change(ROLE, resource, "update",
                               f"{have['active']}/{have['enabled']}: start it",
                               [AttrDiff("state", f"{have['active']}/{have['enabled']}",
                                         "active/enabled")]),
                    [mgr.restart(unit)]), True
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


def tcp_wait(address: str, port: int, seconds: int, journal: str | None, who: str) -> str:
    """Readiness by TCP connect: rpc-server exits 0 even when it could not bind (LAB_NOTES)."""
    fail = (f"echo \"{who}: nothing accepts TCP on {address}:{port} after {seconds} s\" >&2; "
            + (journal + "; " if journal else "") + "exit 1")
    return (f"bash -c 'for i in $(seq {seconds}); do (exec 3<>/dev/tcp/{address}/{port}) "
            f"2>/dev/null && exit 0; sleep 1; done; exit 1' || {{ {fail}; }}")


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
        ctx.resolved.restarted.add(f"{ctx.host.name}:{port}")
        have = (ctx.fact("services.Units") or {}).get(unit)
        return Step(ctx.change(ROLE, resource, "create" if have is None else "update",
                               "runs the new build",
                               [AttrDiff("exec_start", None, None, known_after_apply=True)]),
                    deferred=True)
    if isinstance(mgr, Launchd):
        argv, env = argvs.rpc_server_argv(f"{build_dir}/bin/{manifest['rpc_binary']}", ctx.host,
                                          rpc, f"/var/cache/{rpc.unit_name}")
        want = launchd_plist(unit, argv, env, d.services_launchd_log_dir)
    else:
        want = rpc_unit(ctx.cluster, ctx.host, rpc, build_dir, manifest["rpc_binary"])
    step, restarted = _unit_step(ctx, resource, unit, want)
    if restarted:
        ctx.resolved.restarted.add(f"{ctx.host.name}:{port}")
        step.commands.append(tcp_wait(rpc.bind, port, d.services_rpc_probe_seconds,
                                      mgr.journal(unit), f"{ctx.host.name}/{unit}"))
    return step


def stale_units(ctx: HostContext) -> Step:
    """services.cleanup: meshdeploy units the cluster file no longer describes."""
    mgr = manager(ctx)
    wanted = {mgr.name(r.unit_name) for r in ctx.host.rpc_servers}
    wanted |= {mgr.name(s.unit_name) for s in ctx.servers()}
    units = ctx.fact("services.Units") or {}
    stale = sorted(u for u in units if u not in wanted)
    if not stale:
        return Step(ctx.change(ROLE, "cleanup", "no-op", "no stale units"))
    cmds = [mgr.remove(u) for u in stale]
    if not isinstance(mgr, Launchd):
        cmds.append("systemctl daemon-reload")
    return Step(ctx.change(ROLE, "cleanup", "delete", "no longer in the cluster file",
                           [AttrDiff("units", " ".join(stale), None)]), cmds)


def model_sha(ctx: HostContext, name: str) -> str | None:
    resolved = ctx.resolved.models.get(name)
    if isinstance(resolved, HfResolved):
        return resolved.files[0].sha256
    return None


def health_wait(server, journal: str | None = None) -> str:
    """llama-server answers 503 while loading; 200 on /health means ready."""
    h = server.health
    host = "127.0.0.1" if server.bind in ("0.0.0.0", "127.0.0.1") else server.bind
    url = f"http://{host}:{server.port}/health"
    return (f"for i in $(seq {h.retries}); do c=$(curl -s -o /dev/null -w '%{{http_code}}' "
            f"--max-time 5 {url}); [ \"$c\" = 200 ] && exit 0; sleep {h.interval:g}; done; "
            f"echo \"{server.unit_name}: /health not 200 after {h.budget:g} s (last: $c)\" >&2; "
            f"{journal or journal_tail(server.unit_name)}; exit 1")


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
    mgr = manager(ctx)
    unit = mgr.name(server.unit_name)
    if manifest is None:
        have = (ctx.fact("services.Units") or {}).get(unit)
        return Step(ctx.change(ROLE, resource, "create" if have is None else "update",
                               "runs the new build",
                               [AttrDiff("exec_start", None, None, known_after_apply=True)]),
                    deferred=True)
    sha = model_sha(ctx, server.model)
    if isinstance(mgr, Launchd):
        flags = manifest.get("flags")
        argv = argvs.llama_server_argv(f"{build_dir}/bin/llama-server", ctx.cluster, server,
                                       models.model_path(ctx.cluster, server.model),
                                       frozenset(flags) if flags else None)
        want = launchd_plist(unit, argv, {"MESHDEPLOY_MODEL_SHA256": sha} if sha else {},
                             d.services_launchd_log_dir)
    else:
        want = server_unit(ctx.cluster, ctx.host, server, build_dir, manifest.get("flags"), sha)
    step, restarted = _unit_step(ctx, resource, unit, want, reason)
    if restarted:
        checks = [tcp_wait(e.address, e.rpc.port, 10, None, f"{ctx.host.name} -> {e.target}")
                  for e in endpoints]
        step.commands = checks + step.commands + [health_wait(server, mgr.journal(unit))]
    return step
