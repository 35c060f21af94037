"""`meshdeploy status` as text (a table) and JSON, from the same rows (commands/status.py
collects them: host, service, unit, answer, protocol, model, healthy; a role's own lines are
its registry.StatusRow with the host)."""

from __future__ import annotations

import json

from tabulate import tabulate

from meshdeploy.errors import terminal_text


def render_text(rows: list[dict]) -> str:
    """Every cell but `healthy` comes from a host's output: shown, never run by the terminal."""
    table = [[terminal_text(str(cell)) for cell in
              (r["host"], r["service"], r["unit"], r["answer"], r.get("protocol") or "",
               r.get("model") or "")] + ["yes" if r["healthy"] else "NO"] for r in rows]
    return tabulate(table, headers=["host", "service", "unit", "answer", "protocol", "model",
                                    "healthy"])


def render_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2, sort_keys=True)
