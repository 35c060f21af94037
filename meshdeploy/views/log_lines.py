"""The services' log lines for meshdeploy logs: which sources words select, the one script that
reads (and follows) them on a host, its output parsed into `Line`s, and the hosts' lines merged by
time.

Each host runs one script (`host_script`) over fabric: per selected unit, `journalctl -o json`
(launchd hosts: `tail` of the service's log file), each unit's section opened by an `@unit`
line. JSON entries carry their time (`__REALTIME_TIMESTAMP`, microseconds since the epoch, UTC),
so lines of different hosts merge exactly (heapq) whatever the hosts' time zones; only the hosts'
clocks must agree. With -f the script then prints `@follow` and runs `journalctl -f` from the
moment the backlog was read (entries seen twice are dropped by their cursor). A watcher on the
SSH channel's stdin ends every process of the script when the channel closes, so Ctrl-C, a
killed meshdeploy or a dropped connection leaves no journalctl behind on any host.
"""

from __future__ import annotations

import heapq
import json
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Iterable

from meshdeploy.core import shell
from meshdeploy.core.registry import LogSource
from meshdeploy.errors import MeshdeployError, terminal_text
from meshdeploy.views.logs import Line

DEFAULT_LINES = 10  # per service, when neither -n nor --since is given
_SINCE = re.compile(r"(?P<n>\d+)(?P<unit>s|m|h|d)"
                    r"|\d{4}-\d\d-\d\d( \d\d:\d\d(:\d\d)?)?|today|yesterday")


class SelectionError(MeshdeployError):
    """A HOST or SERVICE word names nothing in the cluster file."""


def select(sources: list[LogSource], hosts: list[str], words: list[str]) -> list[LogSource]:
    """The sources any word names (all when there is none), in file order. A word is a host
    name, `rpc-server` or `llama-server`, a server name, a unit name or an rpc-server's
    `host:port`."""
    if not words:
        return list(sources)
    unknown = [w for w in words if w not in hosts and not any(w in s.names for s in sources)]
    if unknown:
        names = sorted({n for s in sources for n in s.names if not n.endswith(".service")
                        and not n.startswith("com.")})
        raise SelectionError(f"{', '.join(unknown)}: no host or service of that name",
                             hint=f"hosts: {', '.join(hosts)}; services: {', '.join(names)}")
    chosen = [s for s in sources if s.host in words or any(w in s.names for w in words)]
    if not chosen:
        raise SelectionError(f"{', '.join(words)}: runs no service meshdeploy manages",
                             hint="services run on: "
                                  + ", ".join(dict.fromkeys(s.host for s in sources)))
    return chosen


def since_value(text: str | None) -> str | None:
    """--since as journalctl reads it: `10m` -> `-10m`; dates pass as they are."""
    if text is None:
        return None
    m = _SINCE.fullmatch(text.strip())
    if not m:
        raise MeshdeployError(f"--since {text!r}: expected a duration (30s, 10m, 2h, 1d) or a "
                              "date (YYYY-MM-DD [HH:MM[:SS]], today, yesterday)")
    return f"-{m['n']}{m['unit']}" if m["n"] else m.group(0)


def since_cutoff(text: str | None, now: datetime | None = None) -> int | None:
    """--since (as the user wrote it) as microseconds since the epoch, for log lines that
    carry their own time (svlogd's): durations back from `now`, dates in local time, as
    journalctl reads them. None without --since."""
    if text is None:
        return None
    now = now or datetime.now().astimezone()
    m = _SINCE.fullmatch(text.strip())
    if m is None:
        raise MeshdeployError(f"--since {text!r}: not a duration or a date")
    if m["n"]:
        seconds = int(m["n"]) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m["unit"]]
        return int((now.timestamp() - seconds) * 1_000_000)
    word = m.group(0)
    if word in ("today", "yesterday"):
        day = now.replace(hour=0, minute=0, second=0, microsecond=0)
        start = day - timedelta(days=1) if word == "yesterday" else day
    else:
        for form in ("%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d"):
            try:
                start = datetime.strptime(word, form).astimezone()
                break
            except ValueError:
                continue
        else:
            raise MeshdeployError(f"--since {text!r}: not a date")
    return int(start.timestamp() * 1_000_000)


def host_script(sources: list[LogSource], lines: int | None, since: str | None,
                follow: bool, manager: str = "") -> str:
    """The one command that reads (and with `follow` then follows) one host's logs.

    + manager: a rootless host's service manager (Layout.manager): systemd-user reads the
      user's journal; runit tails svlogd's files (each source's log file; with --since all
      their lines, which HostStream keeps from `since_cutoff` on)"""
    args = [v for s in sources for v in (s.unit, s.launchd_log)]
    variables = {"MANAGER": manager} if manager else {}
    return shell.template(shell.TEMPLATES / "logs.sh", args=args, LINES=lines, SINCE=since,
                          FOLLOW="1" if follow else None, **variables)


FOLLOW = "@follow"


@dataclass
class HostStream:
    """Turns one host's script output, line by line, into `Line`s."""

    host: str
    order: int
    sources: list[LogSource]
    unit: LogSource | None = None
    launchd: bool = False  # plain lines from log files (launchd's, or runit's svlogd)
    runit: bool = False  # svlogd -tt lines: each begins with its UTC time
    following: bool = False
    since: int | None = None  # --since as microseconds since the epoch (svlogd's lines)

    def feed(self, raw: str, now: int = 0) -> list[Line] | str:
        """The lines `raw` holds ([] for none), or FOLLOW when the backlog has ended."""
        raw = raw.rstrip("\r\n")
        if raw in ("@launchd", RUNIT_MARK):
            self.launchd = True
            self.runit = raw == RUNIT_MARK
            return []
        if raw == FOLLOW:
            self.following = True
            return FOLLOW
        if raw.startswith("@unit "):
            self.unit = self._source(raw[6:], lambda s: s.unit)
            return []
        if self.launchd:
            return self._launchd(raw, now)
        if not raw.startswith("{"):
            return []
        try:
            entry = json.loads(raw)
        except ValueError:
            return []
        source = self._of_entry(entry) or self.unit
        if source is None:
            return []
        text = _message(entry.get("MESSAGE"))
        when = int(entry.get("__REALTIME_TIMESTAMP") or now)
        cursor = entry.get("__CURSOR")
        return [Line(when, self.order, self.host, source.service, t, cursor)
                for t in text.split("\n")]

    def _launchd(self, raw: str, now: int) -> list[Line]:
        header = re.fullmatch(r"==> (.*) <==", raw)
        if header:  # tail -F names the file its next lines come from
            self.unit = self._source(header.group(1), lambda s: s.launchd_log) or self.unit
            return []
        if not raw and self.following or self.unit is None:
            return []
        when, text = _svlogd_time(raw) if self.runit else (None, raw)
        if self.since is not None and when is not None and when < self.since:
            return []
        return [Line(when or now, self.order, self.host, self.unit.service, terminal_text(text))]

    def _source(self, value: str, field) -> LogSource | None:
        return next((s for s in self.sources if field(s) == value), None)

    def _of_entry(self, entry: dict) -> LogSource | None:
        # journalctl -u U also shows systemd's own lines about U (UNIT=, from PID 1).
        for key in ("_SYSTEMD_UNIT", "UNIT", "OBJECT_SYSTEMD_UNIT"):
            unit = str(entry.get(key) or "").removesuffix(".service")
            source = self._source(unit, lambda s: s.unit) if unit else None
            if source is not None:
                return source
        return None


RUNIT_MARK = "@runit"
# svlogd -tt: "2026-11-26_16:40:54.12345 " before each line, UTC.
_SVLOGD_TIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)_(\d\d):(\d\d):(\d\d)\.(\d{1,9}) (.*)", re.S)


def _svlogd_time(raw: str) -> tuple[int | None, str]:
    """(microseconds since the epoch, text) of an svlogd -tt line; (None, raw) without a time."""
    m = _SVLOGD_TIME.fullmatch(raw)
    if not m:
        return None, raw
    try:
        when = datetime(*(int(m.group(i)) for i in range(1, 7)), tzinfo=timezone.utc)
    except ValueError:
        return None, raw
    micros = int((m.group(7) + "000000")[:6])
    return int(when.timestamp()) * 1_000_000 + micros, m.group(8)


def _message(value) -> str:
    """MESSAGE as text: journalctl's JSON gives non-UTF-8 messages as a list of byte values."""
    if isinstance(value, list):
        try:
            value = bytes(value).decode("utf-8", "replace")
        except (TypeError, ValueError):
            value = ""
    return terminal_text(str(value or "").rstrip("\n"))


def parse(stream: HostStream, output: str, now: int = 0) -> list[Line]:
    """Every line of one host's backlog, oldest first."""
    out: list[Line] = []
    for raw in output.splitlines():
        got = stream.feed(raw, now)
        if got != FOLLOW:
            out += got
    return sorted(out, key=lambda line: line.time)


def merge(per_host: Iterable[list[Line]]) -> Iterable[Line]:
    """The hosts' lines (each list oldest first) as one stream, oldest first, file order on
    ties."""
    return heapq.merge(*per_host, key=lambda line: (line.time, line.order))
