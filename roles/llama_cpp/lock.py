"""The lock file: the commit a tag or branch was resolved to, recorded next to the cluster file.

Like a Terraform or npm lock it makes every host, and every later run, build the same commit
even when the ref moves upstream; the plan only warns that it moved.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from meshdeploy.roles.llama_cpp import defaults as d

FULL_COMMIT = re.compile(r"^[0-9a-f]{40}$")
BUILD_TAG = re.compile(r"^b(\d+)$")


def lock_path(cluster_path: Path) -> Path:
    return cluster_path.with_name(cluster_path.stem + d.llama_cpp_lock_suffix)


def read_lock(cluster_path: Path) -> dict:
    path = lock_path(cluster_path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}


def locked_commit(cluster, lock: dict) -> str | None:
    entry = lock.get("llama_cpp") or {}
    if entry.get("repo") == cluster.llama_cpp.repo and entry.get("ref") == cluster.llama_cpp.ref:
        return entry.get("commit")
    return None


def write_lock(cluster_path: Path, repo: str, ref: str, commit: str) -> None:
    path = lock_path(cluster_path)
    data = read_lock(cluster_path)
    data["llama_cpp"] = {"repo": repo, "ref": ref, "commit": commit}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def build_number(ref: str) -> int | None:
    """Upstream tags builds as bNNNN; for other refs the build counts commits at build time."""
    match = BUILD_TAG.match(ref)
    return int(match.group(1)) if match else None
