"""The one place of commit and lock logic: which llama.cpp commit every host builds, and the lock
file recording the commit a tag or branch was resolved to, next to the cluster file.

Like a Terraform or npm lock it makes every host, and every later run, build the same commit
even when the ref moves upstream; the plan only warns that it moved.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from meshdeploy.core.files import write_atomic
from meshdeploy.errors import ApplyError, PlanError
from meshdeploy.roles.llama_cpp import defaults as d
from meshdeploy.roles.llama_cpp import settings
from meshdeploy.roles.llama_cpp.facts import COMMIT, RemoteRef, ls_remote, pick_ls_remote

# Use with fullmatch: `$` also matches before a final newline.
FULL_COMMIT = COMMIT
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
    if entry.get("repo") == settings.of(cluster).repo and entry.get("ref") == settings.of(cluster).ref:
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
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n", 0o644)


def build_number(ref: str) -> int | None:
    """Upstream tags builds as bNNNN; for other refs the build counts commits at build time."""
    match = BUILD_TAG.fullmatch(ref)
    return int(match.group(1)) if match else None


# -- the commit every host builds -------------------------------------------------------------------

def checked_commit(commit: str) -> str:
    """A commit goes to git only as 40 lowercase hex, whatever produced it."""
    if not isinstance(commit, str) or not FULL_COMMIT.fullmatch(commit):
        raise PlanError(f"llama.cpp commit {commit!r} is not 40 lowercase hex digits",
                        hint="pin llama_cpp.ref to a tag, branch or full commit, and delete a "
                             "hand-edited lock file entry")
    return commit


def known_commit(cluster) -> str | None:
    """The commit before any host is asked: a pinned full commit, else the lock file's."""
    if FULL_COMMIT.fullmatch(settings.of(cluster).ref):
        return settings.of(cluster).ref
    return locked_commit(cluster, read_lock(cluster.path))


def resolve(cluster, upstream: str | None, first: str | None) -> tuple[str | None, str]:
    """(commit to build, how it was decided), given where the first host's ls-remote says the
    ref points (RemoteRef: a commit, MISSING, or None when unknown).

    The repository URL is the hosts' view of it (a mirror on their network may be unreachable
    from here), so refs are resolved on the first host, never from the control machine.
    """
    ref = settings.of(cluster).ref
    if upstream == RemoteRef.MISSING:
        raise PlanError(f"llama_cpp.ref {ref!r} does not exist in {settings.of(cluster).repo} "
                        f"(ls-remote on {first})",
                        hint="use a tag, branch or full commit of that repository")
    if FULL_COMMIT.fullmatch(ref):
        return ref, "pinned commit"
    locked = locked_commit(cluster, read_lock(cluster.path))
    if locked:
        return locked, "lock file"
    if upstream:
        return upstream, f"ls-remote on {first}"
    return None, "unresolved"


def moved_warning(cluster, upstream: str | None) -> list[str]:
    """The plan's note when the ref moved upstream since the lock recorded it."""
    locked = locked_commit(cluster, read_lock(cluster.path))
    if locked and upstream and upstream != locked:
        return [f"llama.cpp {settings.of(cluster).ref} now points at {upstream[:12]} upstream; "
                f"the lock keeps {locked[:12]}. To move, delete the llama_cpp entry of "
                f"{lock_path(cluster.path).name} and plan again."]
    return []


def record(cluster, commit: str | None, source: str) -> None:
    """A ref the plan resolved by ls-remote is recorded before any host builds it."""
    if commit and source.startswith("ls-remote"):
        write_lock(cluster.path, settings.of(cluster).repo, settings.of(cluster).ref, commit)


def resolve_on_host(ctx) -> dict:
    """At apply, when the plan could not resolve the ref (no git anywhere yet): ls-remote on the
    first host once the toolchain is there, recorded in the lock file before anything builds.
    Returns the commit."""
    cluster = ctx.cluster
    ref, repo = settings.of(cluster).ref, settings.of(cluster).repo
    # As the login user: resolving a ref needs no root, and the repository is a value.
    ok, lines = ctx.run_command(ls_remote(repo, ref))
    commit = pick_ls_remote(lines) if ok else None
    if not commit:
        raise ApplyError(f"{ctx.host.name}: llama_cpp.ref {ref!r} does not exist in {repo}",
                        hint="use a tag, branch or full commit of that repository")
    write_lock(cluster.path, repo, ref, commit)
    return commit
