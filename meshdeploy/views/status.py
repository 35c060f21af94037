"""`meshdeploy status` as text (a table) and JSON, from the same rows (commands/status.py
collects them: host, service, unit, answer, protocol, model, healthy, and for a llama-server
gen_tps and generated from its /metrics; a role's own lines are
its registry.StatusRow with the host)."""

from __future__ import annotations

import json

from tabulate import tabulate

from meshdeploy.errors import terminal_text


def render_text(rows: list[dict]) -> str:
    """Every cell but `healthy` comes from a host's output: shown, never run by the terminal."""
    table = [[terminal_text(str(cell)) for cell in
              (r["host"], r["service"], r["unit"], r["answer"], r.get("protocol") or "",
               r.get("model") or "", _generation(r))] + ["yes" if r["healthy"] else "NO"]
             for r in rows]
    return tabulate(table, headers=["host", "service", "unit", "answer", "protocol", "model",
                                    "gen t/s", "healthy"], disable_numparse=True)


def _generation(r: dict) -> str:
    """A llama-server's mean generation rate since it started, over how many tokens."""
    if r.get("gen_tps") is None:
        return ""
    return f"{r['gen_tps']:.2f} ({r['generated']} tokens)"


def render_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2, sort_keys=True)
