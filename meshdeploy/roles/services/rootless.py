"""The services' definitions on a rootless host: systemd --user units and runit `run` scripts.

Both run the same command lines as on a host with root (argv.py); what differs is what the
user's own manager can enforce (the user unit templates' first comment lists what was left out
of the system units, and why) and where things are: the rpc-server's cache is a folder of the
user's (core.paths.rpc_server_cache, made 0700 by the step), and an API key file is read by
llama-server itself (no LoadCredential=: preflight wants it the user's own, 0600 or 0400).
"""

from __future__ import annotations

from pathlib import Path

from meshdeploy.core import shell
from meshdeploy.core.units import comment_value, env_line, exec_line, line_value, render
from meshdeploy.errors import PlanError
from meshdeploy.roles.services import defaults as d
from meshdeploy.roles.services.managers import Runit, SystemdUser

TEMPLATES = Path(__file__).with_name("templates")

# What a started rpc-server says at every start when the cluster file exposes it.
EXPOSED = "meshdeploy: WARNING: RPC on this port is unauthenticated and unencrypted"


USERNS = "services.UserNamespaces"


def file_sandbox(host, writable, userns: bool, where: str) -> str:
    """What a user manager enforces of the system units' file-system sandbox: only inside a
    user namespace of the unit's own (PrivateUsers=yes), which it builds as the unprivileged
    user; without PrivateUsers= it ignores these settings silently, and where the kernel
    refuses the namespace the unit would not start, so such a host gets none (and its plan
    says so). Shown on the lab's systemd 252: each line here works there; ProtectKernelLogs=
    fails the start (226/NAMESPACE), DynamicUser=, CapabilityBoundingSet= outside a user
    namespace (218/CAPABILITIES), IPAddressDeny= and DevicePolicy= (cgroup BPF) cannot work.

    + writable: the folders the service writes (its cache); the rest of home is read-only
    + userns: the UserNamespaces fact"""
    if not userns:
        return ("# No file-system sandbox: this host refuses the login user a user namespace "
                "(services.UserNamespaces),\n# in which alone a user manager builds one.\n")
    lines = ["PrivateUsers=yes", "ProtectSystem=strict", "ProtectHome=read-only",
             *(f"ReadWritePaths={_path_value(w, where)}" for w in writable),
             "PrivateTmp=yes",
             # The user's runtime folder: its systemd and D-Bus sockets, through which a
             # taken-over service could start units without this sandbox.
             "InaccessiblePaths=%t",
             "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectControlGroups=yes",
             "ProtectClock=yes", "ProtectHostname=yes", "ProtectProc=invisible",
             "CapabilityBoundingSet="]
    if not d.services_device_allow.get(host.backend):
        lines.append("PrivateDevices=yes")  # a GPU backend's device nodes stay visible
    return "".join(line + "\n" for line in lines)


def _path_value(path: str, where: str) -> str:
    """An absolute path as one item of a path list (ReadWritePaths=), which systemd splits at
    whitespace and unquotes: a path with whitespace, quotes or backslashes is refused."""
    text = line_value(path, where)
    if not text.startswith("/") or any(c in text for c in " \t\"'\\"):
        raise PlanError(f"{where}: {path!r} cannot be named in ReadWritePaths= (an absolute path "
                        "without whitespace, quotes or backslashes)",
                        hint="set XDG_CACHE_HOME to such a folder for the login user")
    return text


def user_unit(template: str, cluster, host, argv: list, env: dict, where: str,
              exposed: bool = False, writable=(), userns: bool = False, failover: str = "",
              **values) -> str:
    """A systemd --user unit from `template` (rpc-server.user.service or
    llama-server.user.service)."""
    pre = f'ExecStartPre=/bin/echo "{EXPOSED}"\n' if exposed else ""
    # Each folder it writes made again at every start, outside the sandbox ("+": the user's
    # own rights, no namespace), before ReadWritePaths= must find it: a user who empties
    # ~/.cache leaves a unit that starts, not one that fails until the next apply.
    pre += "".join(f"ExecStartPre=+{exec_line(['/bin/mkdir', '-p', '-m', '700', w], where)}\n"
                   for w in writable)
    sandbox = "MemoryDenyWriteExecute=yes\n" if host.backend in d.services_deny_write_execute \
        else ""
    sandbox += file_sandbox(host, writable, userns, where)
    return render(TEMPLATES / template, cluster=comment_value(cluster.name, "cluster"),
                  exec_start=exec_line(argv, f"{where} (ExecStart)"),
                  environment="".join(env_line(k, v, f"{where} (Environment)")
                                      for k, v in sorted(env.items())),
                  pre=pre, sandbox=sandbox, failover=failover, **values)


def runit_run(cluster, argv: list, env: dict, description: str, sh: str | None,
              where: str, exposed: bool = False, writable=()) -> str:
    """A runit service's `run`: sh runs it (the host's own, from the RunitTools fact), every
    value a quoted word (core.shell), the environment exported, stderr joined to stdout (svlogd
    keeps both), the folders it writes made again (`writable`: a user who empties ~/.cache
    loses nothing but what was in them), then exec of the binary, so runsv supervises the
    server itself."""
    if not sh:
        raise PlanError(f"{where}: the host has no sh on PATH for runit's run scripts",
                        hint="install runit's tools (Termux: pkg install termux-services)")
    if not sh.startswith("/") or any(c.isspace() for c in sh):
        raise PlanError(f"{where}: sh at {sh!r} cannot be named on a #! line")
    if not argv[0].startswith("/"):
        raise PlanError(f"{where}: the program {argv[0]!r} is not an absolute path")
    environment = "".join(f"export {shell.assign(k, v)}\n" for k, v in sorted(env.items()))
    pre = shell.command("echo", EXPOSED) + "\n" if exposed else ""
    pre += "".join(shell.command("mkdir", "-p", "-m", "700", w) + "\n" for w in writable)
    return render(TEMPLATES / "runit.run", sh=sh, cluster=comment_value(cluster.name, "cluster"),
                  description=comment_value(description, where), environment=environment,
                  pre=pre, argv=shell.join(argv))


def make_cache(path: str) -> str:
    """A folder of the user's cache a rootless service writes (an rpc-server's LLAMA_CACHE,
    md-failover's state): made 0700."""
    return shell.command("mkdir", "-p", path, shell.AND, "chmod", "700", path)


def check_key_file(ctx, server, fact: dict) -> None:
    """On a rootless host llama-server reads its API key file as the login user: the file must
    be that user's, readable by nobody else (0600 or 0400)."""
    path = server.api_key_file
    where = f"servers.{server.name}.api_key_file {path} on host {ctx.host.name}"
    quoted = shell.quote(path)
    if not fact["exists"]:
        raise PlanError(f"{where} does not exist",
                        hint=f"create it, readable by the login user only: install -m 600 "
                             f"/dev/null {quoted}; then write the key into it")
    loose = fact["mode"] & 0o077
    owned = fact["uid"] == fact.get("reader")
    if loose or not owned:
        raise PlanError(f"{where} is mode {fact['mode']:04o}, owned by {fact['owner']}: "
                        "only the login user may read it (llama-server runs as that user)",
                        hint=(f"chmod 600 {quoted}" if owned
                              else f"copy it to a file of the login user's: install -m 600 "
                                   f"{quoted} ~/.config/meshdeploy/api-key, and name that in "
                                   "the cluster file")
                        + ("; others could read it: replace the key if it may have leaked"
                           if loose else ""))


def want(ctx, mgr, where: str, argv: list, env: dict, description: str,
                   template: str, exposed: bool = False, after: str | None = None,
                   writable=(), failover: str = "", **values) -> str:
    """A rootless host's definition: a systemd --user unit, or a runit `run` script.

    + after: whole lines a unit template takes as ${after} (ordered_after's; runit has no
      ordering: llama-server's worker checks stand for it)
    + writable: folders the service writes (made at each start; in a systemd --user unit's
      sandbox, the ones it may write)"""
    if isinstance(mgr, Runit):
        # Without the RunitTools fact at all (a plan rendered without a probe) the POSIX path
        # stands in; a probed host without sh was refused at preflight.
        sh = mgr.tools.get("sh") if ctx.fact("services.RunitTools") is not None else "/bin/sh"
        return runit_run(ctx.cluster, argv, env, description, sh, where, exposed, writable)
    quoted = {k: line_value(v, where) if isinstance(v, str) else v for k, v in values.items()}
    if after is not None:
        quoted["after"] = after
    return user_unit(template, ctx.cluster, ctx.host, argv, env, where, exposed,
                     writable=writable, userns=bool(ctx.fact(USERNS)), failover=failover,
                     **quoted)


# health.sh reads the unit's restart count with `systemctl show -p NRestarts`: on a rootless
# host a shell function of that name stands in for it. systemd --user keeps the same count;
# runit keeps none (runsv restarts a service that exits a second later and only says since
# when the current process runs), so there nothing is read and the whole budget is waited.
_USER_RESTARTS = 'systemctl() { command systemctl --user "$@"; }'
_NO_RESTARTS = "systemctl() { return 1; }"


def restarts_shim(mgr) -> str:
    if isinstance(mgr, SystemdUser):
        return _USER_RESTARTS
    return _NO_RESTARTS if isinstance(mgr, Runit) else ""
