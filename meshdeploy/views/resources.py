"""`meshdeploy resources`: the registry as a table, plain or Markdown."""

from __future__ import annotations

from tabulate import tabulate

from meshdeploy.core.registry import Resource


def render_text(resources: list[Resource], markdown: bool = False) -> str:
    rows = [[r.qualified, f"roles/{r.role}",
             "per key" if r.keys else "per host",
             r.doc + (" (apply only)" if r.apply_only else "")]
            for r in resources]
    return tabulate(rows, headers=["resource", "code", "instances", "what it manages"],
                    tablefmt="github" if markdown else "simple")
