"""`meshdeploy state`: the state file as JSON (show), and what a rebuild found (rebuild)."""

from __future__ import annotations

import json


def render_json(state: dict) -> str:
    return json.dumps(state, indent=2, sort_keys=True)


def render_rebuilt(found: dict[str, list[str]], path: str, recorded: int) -> str:
    """One line per host of the file (what of meshdeploy's the probe found there), then where
    the state was written and how many hosts it records."""
    lines = [f"{host}: " + (", ".join(things) if things else "nothing of meshdeploy's")
             for host, things in found.items()]
    return "\n".join(lines + [f"\nWrote {path} ({recorded} of {len(found)} hosts)."])
