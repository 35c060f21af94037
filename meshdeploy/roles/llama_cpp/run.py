"""What the llama_cpp role fixes for a run before any host changes (its prepare hook's values,
kept under its name in Resolved; llama_cpp.resolve fixes them again at apply when the plan
could not resolve the ref)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLE = "llama_cpp"


@dataclass(frozen=True)
class Run:
    # The commit every host builds; None when the ref could not be resolved yet (no host has
    # git and the control machine cannot reach the repository): the plan says "(known after
    # apply)" and apply resolves it on the first host right after the toolchain is in place.
    commit: str | None = None
    commit_source: str = "unresolved"  # "pinned commit", "lock file", "ls-remote on <host>"
    build_number: int | None = None
    upstream_commit: str | None = None  # what the ref points at now, when it was checked
    # Host name -> the hosts that copy the llama.cpp build it compiles (file order): the
    # toolchain gives them the copy set, the network opens md-share's port on it to them
    # (they read it as Resolved.value(ROLE, "build_copiers")).
    build_copiers: dict = field(default_factory=dict)


def of(resolved) -> Run:
    """The run's values (empty ones where the role's prepare has not run: a test's Resolved)."""
    return resolved.of(ROLE) or Run()
