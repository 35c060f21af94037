"""Measured device speeds, kept between runs: `<cluster-file-stem>.speed.json` beside the
cluster file (and its bench and lock files).

`meshdeploy bench --sweep` writes a server's entry (roles.rpc_cache.speed.Calibration.to_json(),
with the splits it measured and when); the planner reads every entry and hands them to the
roles (registry.Prepare.speeds), where `placement: auto` uses one only while it still matches
the server's devices, build and model. A plan never measures: without a current entry it
splits by memory and says so.
"""

from __future__ import annotations

import json
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
    return {k: v for k, v in servers.items() if isinstance(v, dict)} \
        if isinstance(servers, dict) else {}


def write(cluster_path: Path, server: str, entry: dict) -> Path:
    """Replace `server`'s entry (the others stay); atomic, never through a planted link."""
    target = path(cluster_path)
    servers = read(cluster_path)
    servers[server] = entry
    write_atomic(target, json.dumps({"format_version": FORMAT_VERSION, "servers": servers},
                                    indent=2, sort_keys=True) + "\n", 0o644)
    return target
