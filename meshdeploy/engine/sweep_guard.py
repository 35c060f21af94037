"""What brings the deployed llama-server back when `bench --sweep` cannot: a dead-man timer on
the orchestrator, and SIGTERM and SIGHUP turned into an interrupt.

The sweep stops the deployed server for minutes. Before it does, Deadman.arm sets a transient
systemd timer on the orchestrator that, `seconds` later, stops the sweep's copies and starts
the deployed unit. The sweep arms a fresh one before each of its steps (the next one before
the last is cancelled: two names taken in turn, so one is always armed) and cancels them once it
has started the server itself. A control machine that dies, is killed with SIGKILL or loses its
SSH connection leaves the server stopped for `seconds` at most, however long the sweep was meant
to run. The timer lives in the system manager (the sweep runs on root hosts only): it needs no
process of meshdeploy's on the host, nor a connection.

Signals: SIGTERM (systemd stopping a service, `kill`, a CI timeout) and SIGHUP (a closed
terminal or SSH session of the operator's) end a sweep as Ctrl-C does, so its `finally` starts
the server at once; once that has begun, further ones are ignored until it is done.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager

from meshdeploy.engine import server_api
from meshdeploy.core import shell

TIMER = "meshdeploy-sweep-restart-{name}-{k}"
# seconds: a step of the sweep (one split, loading included, or the model on the orchestrator
# alone) must end within them, or the timer starts the deployed server during it.
SECONDS = 600

# md_unit_free: a timer of the name cancelled a moment ago may still be loaded. The service the
# timer starts stops the copies first ("-": also when none runs; an rpc-server serves one client at a time: the deployed
# server could not connect while a copy holds its workers), then starts the deployed unit.
_ARM = ('md_unit_free "$NAME.timer" && md_unit_free "$NAME.service" || exit 1\n'
        'systemd-run --quiet --unit "$NAME" --on-active="${AFTER}s" '
        '--timer-property=AccuracySec=1s -p "ExecStartPre=-systemctl stop $COPIES" '
        '-- systemctl start "$UNIT"')
_CANCEL = ('for n do systemctl stop "$n.timer" 2>/dev/null; systemctl reset-failed "$n.timer" '
           '"$n.service" 2>/dev/null; done; true')


class Deadman:
    """The dead-man timers of one sweep of `server`; `copies`: the units of its copies."""

    def __init__(self, conn, sudo: bool, server, seconds: int, copies: list[str]):
        self.conn, self.sudo, self.seconds = conn, sudo, seconds
        self.unit, self.copies = server.unit_name, copies
        self.names = [TIMER.format(name=server.name, k=k) for k in (0, 1)]
        self.armed: int | None = None

    def arm(self) -> None:
        """Starts the deployed unit `seconds` from now unless armed again or cancelled."""
        k = 1 if self.armed == 0 else 0
        server_api.run_remote(self.conn, shell.script(
            _ARM, prelude=shell.SYSTEMD_RUN, NAME=self.names[k], AFTER=int(self.seconds),
            COPIES=" ".join(self.copies), UNIT=self.unit), self.sudo)
        if self.armed is not None:
            self._cancel([self.names[self.armed]])
        self.armed = k

    def fired(self) -> bool:
        """Whether the deployed unit runs again (a timer started it: the step took too long)."""
        state = server_api.run_remote(self.conn, shell.command(
            "systemctl", "is-active", self.unit, shell.OR, "true"))
        return state.strip() in ("active", "activating", "reloading")

    def cancel(self) -> None:
        """Both timers stopped (also one an earlier sweep of the server left)."""
        self._cancel(self.names)
        self.armed = None

    def _cancel(self, names: list[str]) -> None:
        server_api.run_remote(self.conn, shell.script(_CANCEL, args=names), self.sudo)


class Hangup(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a sweep: handled as Ctrl-C."""


def _raise(signum, frame):
    error = Hangup(f"{signal.Signals(signum).name} received")
    # Under gevent the handler may run in the hub (the sweep waits on a socket there), which
    # would print the exception's traceback before handing it to the main greenlet: it is
    # thrown into the main greenlet directly, where the sweep's `finally` is.
    import greenlet

    current = main = greenlet.getcurrent()
    while main.parent is not None:
        main = main.parent
    if current is not main:
        main.throw(error)
        return
    raise error


@contextmanager
def interruptible():
    """SIGTERM and SIGHUP raise Hangup inside the block; the handlers before it come back."""
    previous = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def uninterrupted():
    """SIGTERM and SIGHUP ignored inside the block (the server being started again)."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
