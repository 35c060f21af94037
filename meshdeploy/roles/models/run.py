"""What the models role fixes for a run before any host changes (its prepare hook's values,
kept under its name in Resolved)."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLE = "models"


@dataclass(frozen=True)
class Run:
    # Model name -> hf.HfResolved: the revision's commit and each file's size and sha256 as
    # the hub answered at plan time (rpc_cache and services read it as
    # Resolved.value(ROLE, "models")).
    models: dict = field(default_factory=dict)
    # The control machine's Hugging Face token, for gated or private models' downloads.
    hf_token: str | None = field(default=None, repr=False)


def of(resolved) -> Run:
    """The run's values (empty ones where the role's prepare has not run: a test's Resolved)."""
    return resolved.of(ROLE) or Run()
