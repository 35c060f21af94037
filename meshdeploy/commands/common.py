"""What several commands share: gevent's patch, the cluster's locks, the confirmation prompt and
an apply with live progress (plan, apply, destroy, status, state), and the fabric connections of
logs and exec (the pyinfra session and the --limit hosts: engine.hosts)."""

from __future__ import annotations

import os
import sys

from meshdeploy.engine import locks
from meshdeploy.errors import AbortedError, PlanError
from meshdeploy.remote import ssh_settings
from meshdeploy.views import notices
from meshdeploy.views import plan as plan_view
from meshdeploy.views.progress import reporter


def patch_for_gevent() -> None:
    """Patch the standard library for gevent, first thing in the runs of plan, apply, destroy,
    status, state and bench.

    pyinfra connects and gathers facts in greenlets: without the patch, hosts are served one at a
    time through the Python API (the pyinfra CLI patches on import too). bench, which reaches its
    host through fabric, has always run patched with them (remote.connections reads the patched
    pipes of a local host). logs and exec never call it: fabric runs each of their hosts in a
    real thread. Nothing patches on import, so the command line builds its parser, and validate
    runs, without gevent.
    """
    from gevent import monkey

    if not monkey.is_module_patched("socket"):
        monkey.patch_all()


def interrupts_in_main_greenlet() -> None:
    """Ctrl-C raised in the command's own (main) greenlet, never in whichever greenlet runs
    when it comes: a plain SIGINT handler raises KeyboardInterrupt where the interpreter is, and
    under gevent's patch that may be paramiko's transport "thread" (a greenlet), which then dies
    and leaves every later use of its connection waiting for ever (bench's clean-up of its local
    copy hung so). gevent runs this handler from its hub, between greenlets. For the patched
    commands that reach hosts and end on Ctrl-C (bench); apply and destroy have their own
    (execute.interrupt)."""
    import signal

    import gevent

    main = gevent.getcurrent()
    gevent.signal_handler(signal.SIGINT, lambda: main.throw(KeyboardInterrupt()))


def color() -> bool:
    """Colour on a terminal, unless NO_COLOR is set to anything but "" (no-color.org; also what
    --no-color sets)."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


class Locked:
    """The control machine's lock for the whole run, and the hosts' once connected."""

    def __init__(self, cluster, command: str, lock_timeout: str | None = None):
        self.holder = locks.me(command)
        self.timeout = locks.duration(lock_timeout or "0")
        self.control = locks.ControlLock(cluster.path, self.holder, self.timeout)
        self.on_hosts = None

    def __enter__(self):
        self.control.acquire()
        return self

    def hosts(self, session) -> None:
        self.on_hosts = locks.HostLocks(session, self.holder, self.timeout).__enter__()

    def release_hosts(self) -> None:
        if self.on_hosts is not None:
            self.on_hosts.release()
            self.on_hosts = None

    def __exit__(self, *exc):
        self.release_hosts()
        self.control.release()


def confirm(what: str = "apply") -> bool:
    if not sys.stdin.isatty():
        raise AbortedError(f"{what} needs confirmation, and stdin is not a terminal",
                           hint="rerun with --auto-approve" +
                                (", or apply a saved plan file" if what == "apply" else ""))
    print(plan_view.CONFIRM)
    try:
        return input(plan_view.PROMPT).strip() == "yes"
    except EOFError:
        return False


def run_apply(session, planned, json_output: bool = False, **kwargs) -> list[dict]:
    """execute.apply.apply with live progress: a line per host on a terminal, plain lines in a
    pipe, none with --json (views.progress)."""
    from meshdeploy.execute.apply import apply

    with reporter([h.name for h in session.reached()], json_output) as live:
        session.listener = live.line
        try:
            return apply(session, planned, progress=None if json_output else print,
                         reporter=live, **kwargs)
        finally:
            session.listener = None


def open_hosts(cluster, names: list[str], accept_new_host_keys: bool):
    """fabric connections (remote.connections.Hosts) to the hosts `names`, for logs and exec; a
    host that cannot be reached is named on stderr and left out."""
    from meshdeploy.remote import connections as remote

    settings = [ssh_settings.resolve(cluster.host(n), accept_new=accept_new_host_keys)
                for n in names]
    for warning in ssh_settings.no_check_warnings(settings):
        print(notices.warning(warning), file=sys.stderr)
    hosts = remote.connect(settings)
    for name, reason in hosts.unreachable.items():
        print(notices.unreachable(name, reason), file=sys.stderr)
    return hosts


def read_layouts(cluster, hosts):
    """`cluster` with the layout of each rootless host among the open fabric connections `hosts`
    (remote.connections.Hosts), read as a Session reads it (core.account: one short command per
    rootless host), and {host: reason} for those whose account could not be read or used; hosts
    with root keep their fixed layout. For logs, exec and bench, which do not open a Session."""
    from meshdeploy.core import account
    from meshdeploy.remote import connections as remote

    rootless = {n: c for n, c in hosts.connections.items()
                if cluster.host(n).rootless and cluster.host(n).layout is None}
    if not rootless:
        return cluster, {}
    results = remote.each(remote.Hosts(rootless, {}), lambda name, conn: conn.run(
        remote.as_root(account.SCRIPT, False), hide=True, warn=True, in_stream=False))
    found, failed = {}, {}
    for name, result in results.items():
        if isinstance(result, Exception):
            failed[name] = remote.reason(result)
            continue
        try:
            found[name] = account.layout(account.parse(name, result.stdout.splitlines()))
        except PlanError as exc:
            failed[name] = exc.message + (f" ({exc.hint})" if exc.hint else "")
    return account.resolved(cluster, found), failed
