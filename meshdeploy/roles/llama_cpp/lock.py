"""The lock file: the commit a tag or branch was resolved to, recorded next to the cluster file.

Like a Terraform or npm lock it makes every host, and every later run, build the same commit
even when the ref moves upstream; the plan only warns that it moved.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from meshdeploy.deploy.errors import PlanError
from meshdeploy.roles.llama_cpp import defaults as d

# Use with fullmatch: `$` also matches before a final newline.
FULL_COMMIT = re.compile(r"[0-9a-f]{40}")
BUILD_TAG = re.compile(r"b(\d+)")


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
    """The commit the lock file records for this repo and ref; PlanError when that entry holds
    anything but 40 lowercase hex (a hand-edited or corrupted lock is never passed to git)."""
    entry = lock.get("llama_cpp") if isinstance(lock, dict) else None
    if not isinstance(entry, dict):
        return None
    if entry.get("repo") == cluster.llama_cpp.repo and entry.get("ref") == cluster.llama_cpp.ref:
        commit = entry.get("commit")
        if not isinstance(commit, str) or not FULL_COMMIT.fullmatch(commit):
            path = lock_path(cluster.path)
            raise PlanError(f"{path}: llama_cpp.commit {commit!r} is not a 40-hex commit",
                            hint=f"delete the llama_cpp entry of {path.name} and plan again")
        return commit
    return None


def write_lock(cluster_path: Path, repo: str, ref: str, commit: str) -> None:
    if not FULL_COMMIT.fullmatch(commit):
        raise PlanError(f"refusing to lock llama.cpp to {commit!r}: not a 40-hex commit")
    path = lock_path(cluster_path)
    data = read_lock(cluster_path)
    if not isinstance(data, dict):
        data = {}
    data["llama_cpp"] = {"repo": repo, "ref": ref, "commit": commit}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def build_number(ref: str) -> int | None:
    """Upstream tags builds as bNNNN; for other refs the build counts commits at build time."""
    match = BUILD_TAG.fullmatch(ref)
    return int(match.group(1)) if match else None
