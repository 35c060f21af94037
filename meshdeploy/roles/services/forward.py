"""services.ssh_forward: under network.transport: ssh, an orchestrator's OpenSSH forward to one
worker, supervised by the orchestrator's own service manager.

Every form runs the same script (templates/ssh-forward.sh) with `sh -c`, its inputs as
positional parameters: a systemd unit (DynamicUser=, the key and known_hosts as credentials, the
control socket in its RuntimeDirectory=), a systemd --user unit or a runit service on a rootless
orchestrator (the user's own files, the socket in Layout.run). The login user on the worker is
what the network role's SshLogin fact read there.
"""

from __future__ import annotations

import re
from pathlib import Path

from meshdeploy.config.model import SshForward
from meshdeploy.core import share, shell
from meshdeploy.core.context import HostContext, Step
from meshdeploy.core.paths import model_share_port, ssh_key, ssh_known_hosts
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.registry import StatusProbe, StatusRow
from meshdeploy.core.units import (
    SystemdExpr,
    comment_value,
    exec_arg,
    exec_script,
    line_value,
    ordered_after,
    render,
    unit_name,
)
from meshdeploy.errors import PlanError
from meshdeploy.roles.services import operations as ops
from meshdeploy.roles.services import rootless, unit_files
from meshdeploy.roles.services.managers import Launchd, Runit, SystemdUser

ROLE = "services"
TEMPLATES = Path(__file__).with_name("templates")
SCRIPT = TEMPLATES / "ssh-forward.sh"
READY_SECONDS = 20  # every loopback port of a (re)started forward accepts within this
LOGIN = "network.SshLogin"
# ssh expands `%` tokens, `${VAR}` and (in -o values) quotes and backslashes in its paths: a
# path with one of these would name another file.
_SSH_UNSAFE = re.compile(r'[%$"\\]')
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def keys(cluster) -> list[str]:
    """services.ssh_forward's instances: every worker some host forwards to."""
    return sorted({f.worker.name for h in cluster.hosts for f in cluster.ssh_forwards(h)})


def of(cluster, host, worker: str) -> SshForward | None:
    return next((f for f in cluster.ssh_forwards(host) if f.worker.name == worker), None)


def after_lines(cluster, host) -> str:
    """llama-server's After=/Wants= on its host's forwards (systemd, system and user)."""
    return "".join(ordered_after(f.unit_name, f"network.transport (forward to {f.worker.name})")
                   for f in cluster.ssh_forwards(host))


def _ssh_path(path, what: str):
    if not isinstance(path, SystemdExpr) and _SSH_UNSAFE.search(str(path)):
        raise PlanError(f"{what}: {str(path)!r} holds a character ssh would expand or unquote "
                        "(% $ \" \\)", hint="use a path without them")
    return path


def reverse(cluster, host, forward: SshForward) -> str | None:
    """The forward's reverse end, `R=127.0.0.1:PORT:127.0.0.1:<md-share's port>`, when `host`'s
    md-share serves the worker model bytes (share.reverse_port; the cluster file's check_ports
    keeps the worker's services off PORT), else None."""
    port = share.reverse_port(cluster, host.name, forward.worker.name)
    return None if port is None else f"R=127.0.0.1:{int(port)}:127.0.0.1:{model_share_port}"


def args(cluster, host, forward: SshForward, ctl, key, known, user: str) -> list:
    """ssh-forward.sh's positional parameters."""
    where = f"the forward to {forward.worker.name}"
    if not _USER.fullmatch(user):
        raise PlanError(f"{where}: the worker's login user {user!r} is not a portable user name")
    back = reverse(cluster, host, forward)
    return [_ssh_path(ctl, f"{where}: control socket"), _ssh_path(key, f"{where}: key"),
            _ssh_path(known, f"{where}: known_hosts"), int(forward.worker.ssh.port), user,
            forward.worker.address,
            *(f"127.0.0.1:{int(local)}:127.0.0.1:{int(port)}" for local, port in forward.ports),
            *([back] if back else [])]


def _description(forward) -> str:
    return f"OpenSSH forward to {forward.worker.name} ({forward.worker.address}) (meshdeploy)"


def system_unit(cluster, host, forward: SshForward, user: str) -> str:
    where = f"network.transport (forward to {forward.worker.name})"
    unit = unit_name(forward.unit_name, where)
    argv = args(cluster, host, forward, SystemdExpr("${RUNTIME_DIRECTORY}/ctl"),
                SystemdExpr("${CREDENTIALS_DIRECTORY}/key"),
                SystemdExpr("${CREDENTIALS_DIRECTORY}/known_hosts"), user)
    exec_start = " ".join([exec_arg("/bin/sh", where), "-c",
                           exec_script(str(shell.body(SCRIPT)), where), "ssh-forward",
                           *(exec_arg(a, where) for a in argv)])
    return render(TEMPLATES / "ssh-forward.service",
                  cluster=comment_value(cluster.name, "cluster"),
                  worker=comment_value(forward.worker.name, where),
                  address=line_value(forward.worker.address, where), exec_start=exec_start,
                  key=line_value(ssh_key(host.layout), where),
                  known_hosts=line_value(ssh_known_hosts(host.layout), where), unit=unit,
                  firewall=unit_files.firewall([forward.worker.address], f"{where} (IPAddressAllow)"))


def _user_args(cluster, host, forward, user) -> list:
    layout = host.layout
    return args(cluster, host, forward, f"{layout.run}/ssh-{forward.worker.name}.ctl",
                ssh_key(layout), ssh_known_hosts(layout), user)


def user_unit(cluster, host, forward: SshForward, user: str) -> str:
    where = f"network.transport (forward to {forward.worker.name})"
    argv = _user_args(cluster, host, forward, user)
    exec_start = " ".join([exec_arg("/bin/sh", where), "-c",
                           exec_script(str(shell.body(SCRIPT)), where), "ssh-forward",
                           *(exec_arg(a, where) for a in argv)])
    return render(TEMPLATES / "ssh-forward.user.service",
                  cluster=comment_value(cluster.name, "cluster"),
                  worker=comment_value(forward.worker.name, where),
                  address=line_value(forward.worker.address, where), exec_start=exec_start)


def run_script(cluster, host, forward: SshForward, user: str, sh: str | None) -> str:
    where = f"network.transport (forward to {forward.worker.name})"
    argv = [sh or "", "-c", str(shell.body(SCRIPT)), "ssh-forward",
            *_user_args(cluster, host, forward, user)]
    return rootless.runit_run(cluster, argv, {}, _description(forward), sh, where)


def preflight(ctx: HostContext) -> None:
    """A forward on macOS is not written yet: refused rather than left out."""
    if ctx.cluster.ssh_forwards(ctx.host) and isinstance(ops.manager(ctx), Launchd):
        raise PlanError(f"host {ctx.host.name}: network.transport: ssh forwards are not yet on "
                        "macOS (launchd); it orchestrates rpc-servers on other hosts",
                        hint="serve from a Linux host, or use network.transport: plain or "
                             "wireguard")


def ssh_forward(ctx: HostContext, worker: str) -> Step:
    """services.ssh_forward[worker]: this orchestrator's forward to one worker, its every
    loopback port accepting after a (re)start.

    + worker: the worker's host name

    Example: node1/services.ssh_forward[node2]: meshdeploy-ssh-node2, 127.0.0.1:31000 ->
    node2's 127.0.0.1:50052.
    """
    resource = f"ssh_forward[{worker}]"
    forward = of(ctx.cluster, ctx.host, worker)
    if forward is None:
        return Step(ctx.change(ROLE, resource, "no-op", f"no forward to {worker} from here"))
    mgr = ops.manager(ctx)
    unit = mgr.name(forward.unit_name)
    user = (ctx.fact_of(worker, LOGIN) or {}).get("user")
    if not user:
        return _user_unknown(ctx, resource, unit, worker)
    if isinstance(mgr, Runit):
        sh = mgr.tools.get("sh") if ctx.fact("services.RunitTools") is not None else "/bin/sh"
        want = run_script(ctx.cluster, ctx.host, forward, user, sh)
    elif isinstance(mgr, SystemdUser):
        want = user_unit(ctx.cluster, ctx.host, forward, user)
    else:
        want = system_unit(ctx.cluster, ctx.host, forward, user)
    step, restarted = ops._unit_step(ctx, resource, unit, want)
    if restarted:
        step.commands += [ops.tcp_wait("127.0.0.1", local, READY_SECONDS, mgr.journal(unit),
                                       f"{ctx.host.name}/{unit}")
                          for local, _ in forward.ports]
        step.commands.append(owner_check(mgr, unit, f"{ctx.host.name}/{unit}", forward))
    return step


def owner_check(mgr, unit: str, who: str, forward: SshForward) -> str:
    """The forward's ports are held by the forward (ops.port_owner): under systemd (system or
    user) by a socket of the unit's own cgroup, its whole path; under runit by the login
    user's."""
    return ops.port_owner(mgr, unit, who, "the forward", [local for local, _ in forward.ports])


def _user_unknown(ctx, resource: str, unit: str, worker: str) -> Step:
    """The worker's login user is read there by the network role's SshLogin fact; without it
    (the worker was not probed) the forward's command line is known after apply."""
    have = (ctx.fact("services.Units") or {}).get(unit)
    step = Step(ctx.change(ROLE, resource, "create" if have is None else "update",
                           f"{worker}'s login user is not known yet",
                           [AttrDiff("user", None, None, known_after_apply=True)]))
    if ctx.run_command is not None:
        # apply: the fact is still missing, so the forward cannot be written.
        step.commands = [shell.command("echo", f"{ctx.host.name}: the forward to {worker} needs "
                                       f"{worker}'s login user, which its probe did not read",
                                       shell.TO_STDERR) + "; exit 1"]
    return step


STATUS = TEMPLATES / "forward-status.sh"
_STATUS_LINE = re.compile(r"forward (\S+) (\S+) (\d+|\?)/(\d+)")


def status(cluster, host) -> StatusProbe | None:
    """`meshdeploy status` rows of an orchestrator's forwards: each unit's state as its manager
    says it, and how many of its loopback ports have ssh's listener (the master is up with its
    forwards; the rpc-server behind it is the worker's own row), read from the socket table:
    a connect there would reach the worker's rpc-server through the forward and wait in its
    one-place backlog (templates/forward-status.sh)."""
    forwards = cluster.ssh_forwards(host)
    if not forwards:
        return None
    args = [w for f in forwards for w in (
        f.worker.name, f.unit_name, ",".join(str(int(local)) for local, _ in f.ports))]
    script = shell.template(STATUS, args=args, MANAGER=host.layout.manager,
                            SVDIR_MD=host.layout.services)
    names = {f.worker.name for f in forwards}

    def parse(lines: list[str]) -> list[StatusRow]:
        rows, seen = [], set()
        for line in lines:
            m = _STATUS_LINE.fullmatch(line.strip())
            if m is None or m[1] not in names or m[1] in seen:
                continue
            seen.add(m[1])
            state, total = m[2], int(m[4])
            if m[3] == "?":  # no socket table to read: the unit's state alone
                rows.append(StatusRow(f"ssh-forward {m[1]}", state, "loopback ports not "
                                      "checked (no socket table readable here)",
                                      state == "active"))
                continue
            listening = int(m[3])
            rows.append(StatusRow(f"ssh-forward {m[1]}", state,
                                  f"{listening}/{total} loopback ports listening",
                                  state == "active" and listening == total > 0))
        rows += [StatusRow(f"ssh-forward {n}", "unknown", "no status line", False)
                 for n in sorted(names - seen)]
        return rows

    return StatusProbe(script, parse)
