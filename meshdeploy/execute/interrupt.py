"""Ctrl-C during apply, as Terraform handles it: the first lets the steps in flight finish and
starts no other; the second stops those steps on the hosts (inflight.stop_script); a third
leaves at once. Either way the state records what ran and the locks are released before
meshdeploy exits 130. Without this, the remote build or download of an interrupted apply ran on
(no terminal, no SIGHUP) and raced the next apply.
"""

from __future__ import annotations

import os
import signal
import sys

from meshdeploy.core import inflight
from meshdeploy.errors import INTERRUPTED, MeshdeployError


class InterruptedApply(MeshdeployError):
    exit_code = INTERRUPTED


class Interrupts:
    """SIGINT handling while apply's operations run; `count` is how many Ctrl-C came."""

    def __init__(self, session, notes=print):
        self.session = session
        self.notes = notes
        self.count = 0
        self.stopped: list[str] = []  # "host: step" ended by the second Ctrl-C
        self._watcher = None
        self._stopper = None

    @property
    def stopping(self) -> bool:
        return self.count > 0

    def __enter__(self):
        import gevent

        # Runs in a greenlet of its own, so it may reach the hosts while steps run.
        self._watcher = gevent.signal_handler(signal.SIGINT, self._received)
        return self

    def __exit__(self, *exc):
        if self._stopper is not None:
            self._stopper.join(timeout=inflight.GRACE + 30)
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def _received(self) -> None:
        import gevent

        self.count += 1
        if self.count == 1:
            self.notes("\nInterrupt received: no further step starts; the steps in flight "
                       "finish first. Press Ctrl-C again to stop them on the hosts.")
        elif self.count == 2:
            self.notes("\nStopping the steps in flight on the hosts ...")
            self._stopper = gevent.spawn(self._stop_all)
        else:
            self.notes("\nInterrupted three times: leaving now, without saving the state; the "
                       "next apply takes over the locks and stops what still runs.")
            sys.stdout.flush()
            os._exit(INTERRUPTED)

    def _stop_all(self) -> None:
        import gevent

        def one(name: str, layout) -> None:
            try:
                ok, output = self.session.run(name, inflight.stop_script(layout=layout))
            except Exception:  # a host that went away has nothing of ours running
                return
            for step in inflight.parse_stopped(output.stdout_lines if ok else []):
                self.stopped.append(f"{name}: {step}")
                self.notes(f"  {name}: stopped {step}")

        gevent.joinall([gevent.spawn(one, h.name, h.layout) for h in self.session.reached()])

    def error(self, ran: int) -> InterruptedApply:
        how = (f"stopped on the hosts: {', '.join(self.stopped)}" if self.stopped else
               "the steps in flight were stopped" if self.count > 1 else
               "the steps in flight finished")
        return InterruptedApply(f"apply interrupted: {ran} step(s) ran, {how}; no further step "
                                "started. The state records what ran and the locks are released.",
                                hint="run apply again to finish: finished steps are not repeated")
