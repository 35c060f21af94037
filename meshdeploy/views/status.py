"""`meshdeploy status` as text (a table) and JSON, from the same rows (commands/status.py
collects them: host, service, unit, answer, protocol, model, healthy, and for a llama-server
from its /metrics: gen_tps and generated since it started, recent_tps and recent_generated
between two samples `window` seconds apart; a role's own lines are its registry.StatusRow with
the host)."""

from __future__ import annotations

import json

from tabulate import tabulate

from meshdeploy.errors import terminal_text


def render_text(rows: list[dict], state: str | None = None) -> str:
    """Every cell but `healthy` comes from a host's output: shown, never run by the terminal.
    With `state` (commands.status.verdict), a last line says it and what it rests on."""
    table = [[terminal_text(str(cell)) for cell in
              (r["host"], r["service"], r["unit"], r["answer"], r.get("protocol") or "",
               r.get("model") or "", _generation(r))] + ["yes" if r["healthy"] else "NO"]
             for r in rows]
    text = tabulate(table, headers=["host", "service", "unit", "answer", "protocol", "model",
                                    "gen t/s", "healthy"], disable_numparse=True)
    return text if state is None else f"{text}\n\n{summary(rows, state)}"


_MEANING = {"healthy": "every service answers",
            "degraded": "every llama-server answers, but not everything is there",
            "down": "a llama-server does not answer"}


def summary(rows: list[dict], state: str) -> str:
    """`Status: degraded (every llama-server answers, ...); unreachable: node3`."""
    away = [r["host"] for r in rows if r.get("reachable") is False]
    line = f"Status: {state} ({_MEANING.get(state, state)})"
    if away:
        line += f"; unreachable: {', '.join(terminal_text(h) for h in away)}"
    return line


def _generation(r: dict) -> str:
    """A llama-server's recent generation rate: that of the completions that ended between the
    two samples (`window` seconds apart), or that none did; without a second sample, the mean
    since it started."""
    if r.get("window"):
        if r.get("recent_tps") is not None:
            return f"{r['recent_tps']:.2f} ({r['recent_generated']} tokens in {r['window']} s)"
        if r.get("recent_generated") == 0:
            return f"no completion ended in {r['window']} s"
        return ""
    if r.get("gen_tps") is None:
        return ""
    return f"{r['gen_tps']:.2f} since start ({r['generated']} tokens)"


def render_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2, sort_keys=True)
