"""Measured device speeds, kept between runs: `<cluster-file-stem>.speed.json` beside the
cluster file (and its bench and lock files).

`meshdeploy bench --sweep` writes a server's entry (placement.speed.Calibration.to_json(),
with the splits it measured and when); the planner reads every entry and hands them to the
roles (registry.Prepare.speeds), where `placement: auto` uses one only while it still matches
the server's devices, build and model. A plan never measures: without a current entry it
splits by memory and says so.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

from meshdeploy.core.files import write_atomic

FORMAT_VERSION = 1
SUFFIX = ".speed.json"


def path(cluster_path: Path) -> Path:
    cluster_path = Path(cluster_path)
    return cluster_path.with_name(cluster_path.stem + SUFFIX)


def read(cluster_path: Path) -> dict:
    """{server name: kept entry}; {} when there is none, or it cannot be read (a plan then
    splits by memory, as without a measurement)."""
    try:
        data = json.loads(path(cluster_path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        return {}
    servers = data.get("servers")
    return {k: _checked(v) for k, v in servers.items() if isinstance(v, dict)} \
        if isinstance(servers, dict) else {}


def _finite(value) -> bool:
    """Whether every number in `value` is one a float holds (not a 400-digit integer, 1e400,
    NaN or Infinity, which json reads)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return math.isfinite(float(value))
        except OverflowError:
            return False
    if isinstance(value, (dict, list)):
        return all(_finite(v) for v in (value.values() if isinstance(value, dict) else value))
    return True


def _checked(entry: dict) -> dict:
    """The entry as the planner may use it: one holding a number no float holds is replaced
    by {"unreadable": why}, which the plan reports as device speeds it cannot read; a
    `measured_at` that is not an ISO 8601 time is dropped (the plan says "unknown time"), and
    one that is comes back in one fixed spelling, so no other text of the file reaches the
    terminal through it."""
    if not _finite(entry):
        return {"unreadable": "a number in it is out of range"}
    entry = dict(entry)
    try:
        entry["measured_at"] = datetime.fromisoformat(entry["measured_at"]).isoformat(
            timespec="seconds")
    except (KeyError, TypeError, ValueError):
        entry.pop("measured_at", None)
    return entry


def write(cluster_path: Path, server: str, entry: dict) -> Path:
    """Replace `server`'s entry (the others stay); atomic, never through a planted link."""
    target = path(cluster_path)
    servers = read(cluster_path)
    servers[server] = entry
    write_atomic(target, json.dumps({"format_version": FORMAT_VERSION, "servers": servers},
                                    indent=2, sort_keys=True) + "\n", 0o644)
    return target
