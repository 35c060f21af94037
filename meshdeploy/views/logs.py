"""`meshdeploy logs`' lines as the terminal shows them: one `Line` per log line, each rendered
with the host and service in a column as wide as the longest of them."""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from meshdeploy.core.registry import LogSource


class Line(NamedTuple):
    time: int  # microseconds since the epoch (UTC); launchd lines: when they were read
    order: int  # the host's place in the cluster file: ties keep file order
    host: str
    service: str
    text: str
    cursor: str | None = None  # the journal's cursor: the same entry read twice is dropped


def render(line: Line, width: int) -> str:
    """`node2 rpc-server:50052 | 2026-11-23 08:30:01.123 text`"""
    when = datetime.fromtimestamp(line.time / 1e6).isoformat(sep=" ", timespec="milliseconds")
    return f"{line.host + ' ' + line.service:<{width}} | {when} {line.text}"


def width(sources: list[LogSource]) -> int:
    return max((len(s.host) + 1 + len(s.service) for s in sources), default=0)
