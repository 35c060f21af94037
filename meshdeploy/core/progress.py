"""Live progress of apply's long steps: what remote scripts report, parsed into events, kept per
host for the views (views/progress.py).

The wire. A long remote step (the build, a download, seeding, the /health wait) starts a
watcher from `SHELL`: every 2 s, while the script's shell lives, it prints one line to standard
output, `::meshdeploy-progress:: KIND FIELDS...`, read from what the work leaves behind (the last
ninja `[n/m]` line of the build log, the size of the partial download, the md-rpc-seed answers
so far) or, for the /health loop, written by each attempt. The step's own output goes where it
went before (a log file, a partial file), so nothing that breaks on a missing newline (curl's
`\\r` meter, ninja on a TTY) is ever parsed, and a lost line loses nothing but one update.

pyinfra reads a command's standard output line by line while it runs (paramiko's ChannelFile,
read in a greenlet by pyinfra.connectors.util.read_buffer) but hands the lines over only at the
end. `tap()` wraps the connected host's `exec_command` so each marked line goes to the running
apply's `Reporter` as it arrives and is dropped from the command's output (a step that parses
its stdout never sees one); every other line passes untouched.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

MARKER = "::meshdeploy-progress::"
EVERY = 2  # seconds between two lines of one watcher

# Fixed shell put at the top of a script that reports progress (no value of the cluster file
# is in it). md_progress KIND FIELDS... prints one marked line (REPORT defines it alone);
# md_watch FUNC runs FUNC every 2 s in the background while the script's shell lives;
# md_unwatch stops it, its sleep included: the watcher waits for its sleep, so the TERM is
# taken at once and its trap ends the sleep before the watcher exits. A sleep left running
# would outlive the script: in a transient unit its cgroup then stays populated after the
# script exits, and systemd stops the unit and waits for the cgroup to empty (once, on the
# lab, 90 s and a failed seeding). The watcher's sleep holds no descriptor of the SSH channel,
# so the command ends as soon as its script does.
REPORT = "md_progress() { printf '%s %s\\n' '" + MARKER + "' \"$*\"; }"
SHELL = (
    REPORT + "\n"
    "md_watch() { ( s=; trap 'kill $s 2>/dev/null; wait $s 2>/dev/null; exit 0' TERM; "
    "while sleep " + str(EVERY) + " </dev/null >/dev/null 2>&1 & s=$!; wait $s && "
    "kill -0 \"$$\" 2>/dev/null; do \"$@\" || :; done ) & MD_WATCH=$!; }\n"
    "md_unwatch() { kill \"$MD_WATCH\" 2>/dev/null || :; wait \"$MD_WATCH\" 2>/dev/null || :; }"
)


@dataclass(frozen=True)
class Event:
    """One progress report of a step on a host.

    kind: build (done/total: ninja edges), download (bytes; resumed: bytes already there when
    it began), seed (bytes hashed), health (done: attempt, total: the budget's attempts, note:
    the last HTTP code), phase (note: what the step does now, e.g. "configure").
    """

    kind: str
    label: str = ""
    done: int | None = None
    total: int | None = None
    resumed: int = 0
    note: str = ""


_NINJA = re.compile(r"\[(\d+)/(\d+)\]\s*(.*)")


def parse_ninja(text: str) -> Event | None:
    """A ninja status line (`[45/120] Building CXX object ...`, NINJA_STATUS "[%f/%t] ")."""
    m = _NINJA.match(text.strip())
    if not m:
        return None
    done, total = int(m.group(1)), int(m.group(2))
    if total <= 0 or done > total:
        return None
    return Event("build", done=done, total=total, note=m.group(3))


def _counts(kind: str, text: str, n: int) -> Event | None:
    """`N integers, then a label` fields of the download, seed and health lines."""
    words = text.split(None, n)
    # ASCII digits only, and few: "³".isdigit() is true and int() refuses it.
    if len(words) < n or not all(w.isascii() and w.isdigit() and len(w) <= 20 for w in words[:n]):
        return None
    label = words[n] if len(words) > n else ""
    values = [int(w) for w in words[:n]]
    if kind == "download":
        done, total, resumed = values
        return Event(kind, label, done, total, resumed=min(resumed, total))
    if kind == "seed":
        return Event(kind, label, values[0], values[1])
    attempt, budget, code = values
    return Event(kind, label, attempt, budget, note=f"{code:03d}")


def parse(line: str) -> Event | None:
    """The event of one marked output line, None for any other line or a malformed one."""
    if not line.startswith(MARKER):
        return None
    kind, _, rest = line[len(MARKER):].strip().partition(" ")
    if kind == "build":
        return parse_ninja(rest)
    if kind == "download":
        return _counts(kind, rest, 3)
    if kind == "seed":
        return _counts(kind, rest, 2)
    if kind == "health":
        return _counts(kind, rest, 3)
    if kind == "phase" and rest.strip():
        return Event("phase", note=rest.strip())
    return None


class Meter:
    """Rate and ETA of one counter from its recent samples (a 20 s window: a build's rate
    changes as it moves from small C files to the server's large ones)."""

    WINDOW = 20.0

    def __init__(self):
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, done: int) -> None:
        if self.samples and done < self.samples[-1][1]:
            self.samples.clear()  # started over (a partial removed, a new seeding list)
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.WINDOW:
            self.samples.popleft()

    def rate(self) -> float | None:
        """Units per second over the window; None before two samples a second apart."""
        if len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 - t0 >= 1.0 else None

    def eta(self, total: int | None) -> float | None:
        rate = self.rate()
        if not rate or rate <= 0 or total is None:
            return None
        return max(0.0, (total - self.samples[-1][1]) / rate)


@dataclass
class HostProgress:
    """What one host is doing now: its running step, since when, and the last event."""

    host: str
    slot: str | None = None
    since: float | None = None
    event: Event | None = None
    phase: str = ""  # the last phase line ("configure", "verify sha256")
    meter: Meter = field(default_factory=Meter)
    changed: int = 0  # bumped on every begin, end and event: a view prints what is new

    def rate(self) -> float | None:
        return self.meter.rate()

    def eta(self) -> float | None:
        return self.meter.eta(self.event.total if self.event else None)


class Reporter:
    """The running apply's progress, per host: apply tells it which step begins and ends,
    tapped output lines bring events; a view reads `snapshot()` from its own ticker.

    Without a view (--json) lines are still consumed, never shown.
    """

    def __init__(self, hosts, view=None, clock=time.monotonic):
        self.clock = clock
        self.view = view
        self._lock = threading.Lock()
        self.hosts = {h: HostProgress(h) for h in hosts}
        self.events = 0  # lines parsed into events (tests, --debug)

    def _host(self, host: str) -> HostProgress:
        if host not in self.hosts:
            self.hosts[host] = HostProgress(host)
        return self.hosts[host]

    def begin(self, host: str, slot: str) -> None:
        with self._lock:
            h = self._host(host)
            h.slot, h.since, h.event, h.phase, h.meter = slot, self.clock(), None, "", Meter()
            h.changed += 1

    def end(self, host: str, slot: str) -> None:
        with self._lock:
            h = self._host(host)
            if h.slot == slot:
                h.slot, h.since, h.event, h.phase = None, None, None, ""
                h.changed += 1

    def line(self, host: str, text: str) -> bool:
        """A tapped output line of a command on `host`; True when it was progress (consumed,
        even if malformed: a marked line is never a step's output)."""
        if not text.startswith(MARKER):
            return False
        event = parse(text)
        if event is None:
            return True
        with self._lock:
            h = self._host(host)
            now = self.clock()
            if event.kind == "phase":
                h.phase = event.note
            else:
                before = h.event
                if before is not None and (before.kind, before.label) != (event.kind, event.label):
                    h.meter = Meter()
                h.meter.add(now, event.done or 0)
                h.event = event
            h.changed += 1
            self.events += 1
        return True

    def snapshot(self) -> list[HostProgress]:
        """A copy of every host's progress, in the order hosts were given."""
        with self._lock:
            out = []
            for h in self.hosts.values():
                copy = HostProgress(h.host, h.slot, h.since, h.event, h.phase, Meter(), h.changed)
                copy.meter.samples = deque(h.meter.samples)
                out.append(copy)
            return out

    def __enter__(self):
        if self.view is not None:
            self.view.start(self)
        return self

    def __exit__(self, *exc):
        if self.view is not None:
            self.view.stop()


class _Tapped:
    """A command's stdout file whose marked lines go to `on_line` instead of the output."""

    def __init__(self, stream, on_line):
        self._stream, self._on_line = stream, on_line

    def __iter__(self):
        for line in self._stream:
            text = line if isinstance(line, str) else line.decode("utf-8", "replace")
            if text.startswith(MARKER):
                try:
                    self._on_line(text.rstrip("\r\n"))
                except Exception:  # a view's failure must not fail the remote step
                    pass
                continue
            yield line

    def __getattr__(self, name):
        return getattr(self._stream, name)


def tap(client, on_line) -> None:
    """Route the marked stdout lines of every command run on paramiko `client` to
    on_line(text) while they arrive (pyinfra's SSH connector calls client.exec_command)."""
    if getattr(client.exec_command, "_meshdeploy_tap", False):
        return
    original = client.exec_command

    def exec_command(*args, **kwargs):
        stdin, stdout, stderr = original(*args, **kwargs)
        return stdin, _Tapped(stdout, on_line), stderr

    exec_command._meshdeploy_tap = True
    client.exec_command = exec_command
