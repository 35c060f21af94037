"""Views of apply's live progress (core/progress.py): a live line per host on a terminal
(rich), plain throttled lines in a pipe or CI, nothing with --json (no view at all)."""

from __future__ import annotations

import sys
import threading
import time

from meshdeploy.core.progress import HostProgress, Reporter
from meshdeploy.errors import terminal_text

_LOADING = {"503": "503 Loading model", "000": "no answer yet"}


def size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    return f"{seconds // 60} min {seconds % 60:02d} s"


def _percent(done: int | None, total: int | None) -> str:
    return f"{100 * done / total:.0f}%" if total and done is not None else "?%"


def describe(h: HostProgress, now: float) -> str:
    """One line for a host's running step: `llama_cpp.build: [45/120] 37%, 52 steps/min, ETA
    1 min 30 s (1 min 10 s)`; a step without events says how long it has run. Labels and notes
    come from the host (a seeding step runs as a service's user): shown, never run."""
    return terminal_text(_describe(h, now))


def _describe(h: HostProgress, now: float) -> str:
    ran = f"({duration(now - h.since)})" if h.since is not None else ""
    e, rate, eta = h.event, h.rate(), h.eta()
    if e is None:
        return f"{h.slot}: {h.phase or 'running'} {ran}"
    parts = []
    if e.kind == "build":
        parts.append(f"[{e.done}/{e.total}] {_percent(e.done, e.total)}")
        if rate is not None:
            parts.append(f"{rate * 60:.0f} steps/min")
    elif e.kind == "download":
        parts.append(f"{e.label} {size(e.done)} of {size(e.total)} "
                     f"{_percent(e.done, e.total)}")
        if rate is not None:
            parts.append(f"{rate / 1e6:.1f} MB/s")
    elif e.kind == "seed":
        parts.append(f"{size(e.done)} of {size(e.total)} hashed {_percent(e.done, e.total)}")
        if rate is not None:
            parts.append(f"{rate / 1e9:.2f} GB/s")
    elif e.kind == "health":
        answer = _LOADING.get(e.note, f"HTTP {e.note}")
        parts.append(f"{answer}, attempt {e.done} of {e.total}")
    if eta is not None and e.kind != "health":
        parts.append(f"ETA {duration(eta)}")
    if e.kind == "download" and e.resumed:
        parts.append(f"resumed at {size(e.resumed)}")
    if h.phase and e.kind == "build" and e.done == e.total:
        parts.append(h.phase)
    return f"{h.slot}: " + ", ".join(parts) + f" {ran}"


class _Ticker:
    """Calls refresh() every `period` seconds in a thread (a greenlet under gevent's patch)."""

    period = 1.0

    def start(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshdeploy-progress",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.refresh()
            except Exception:  # a broken pipe must not end the apply
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def refresh(self, now: float | None = None) -> None:
        raise NotImplementedError


class PlainView(_Ticker):
    """Plain lines for a pipe or CI: per host, a line once its step has run `every` seconds,
    then at most one every `every` seconds when there is news, and one every `heartbeat`
    seconds when there is none (no silent minute)."""

    def __init__(self, stream=None, every: float = 5.0, heartbeat: float = 30.0):
        self.stream = stream if stream is not None else sys.stdout
        self.every, self.heartbeat = every, heartbeat
        self.printed: dict[str, tuple[float, int, float]] = {}  # host -> (at, changed, since)
        self.reporter: Reporter | None = None

    def refresh(self, now: float | None = None) -> None:
        now = self.reporter.clock() if now is None else now
        lines = []
        for h in self.reporter.snapshot():
            if h.slot is None or h.since is None or now - h.since < self.every:
                continue
            at, changed, since = self.printed.get(h.host, (None, None, None))
            if since != h.since:
                at = None
            due = at is None or (h.changed != changed and now - at >= self.every) or \
                now - at >= self.heartbeat
            if due:
                lines.append(f"  {h.host:<12} {describe(h, now)}")
                self.printed[h.host] = (now, h.changed, h.since)
        if lines:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()


class LiveView:
    """A live line per host on a terminal, drawn by rich; the finished steps' lines that apply
    prints go above it (rich redirects stdout while it is live), and it vanishes at the end."""

    def __init__(self, console=None):
        from rich.console import Console

        self.console = console if console is not None else Console()
        self.reporter: Reporter | None = None
        self.live = None

    def renderable(self, now: float | None = None):
        from rich.table import Table
        from rich.text import Text

        now = self.reporter.clock() if now is None else now
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True, style="bold")
        grid.add_column(no_wrap=True, overflow="ellipsis")
        for h in self.reporter.snapshot():
            grid.add_row(h.host, Text(describe(h, now)) if h.slot else
                         Text("waiting", style="dim"))
        return grid

    def start(self, reporter: Reporter) -> None:
        from rich.live import Live

        self.reporter = reporter
        self.live = Live(get_renderable=self.renderable, console=self.console,
                         refresh_per_second=2, transient=True, redirect_stdout=True,
                         redirect_stderr=False)
        self.live.start()

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def view_for(json_output: bool, stream=None):
    """No view with --json, a live view on a terminal, plain lines otherwise."""
    if json_output:
        return None
    stream = stream if stream is not None else sys.stdout
    if stream.isatty():
        from rich.console import Console

        console = Console(file=stream)
        if console.is_terminal and not console.is_dumb_terminal:
            return LiveView(console)
    return PlainView(stream)


def reporter(hosts, json_output: bool, stream=None, clock=time.monotonic) -> Reporter:
    return Reporter(hosts, view_for(json_output, stream), clock=clock)
