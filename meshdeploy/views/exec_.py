"""`meshdeploy exec`'s answer: each reached host's output under a header, then a table of every
host. What a host printed, or why it could not be reached, is shown, never run by the terminal
(errors.terminal_text)."""

from __future__ import annotations

from dataclasses import dataclass

from tabulate import tabulate

from meshdeploy.errors import terminal_text


@dataclass(frozen=True)
class HostRun:
    """One host's run: its exit code, seconds and output (stdout and stderr joined), or None
    and why it could not be reached."""

    host: str
    exited: int | None
    seconds: float = 0.0
    output: str = ""
    unreachable: str | None = None


def render_text(runs: list[HostRun]) -> str:
    out = []
    rows = []
    for r in runs:
        if r.exited is None:
            rows.append([r.host, "unreachable", "-", terminal_text(r.unreachable or "")])
            continue
        output = terminal_text(r.output)
        out.append(f"== {r.host} (exit {r.exited}, {r.seconds:.2f} s) ==\n")
        out.append(output if output.endswith("\n") or not output else output + "\n")
        rows.append([r.host, r.exited, f"{r.seconds:.2f}", ""])
    return "".join(out) + "\n" + tabulate(rows, headers=["host", "exit", "seconds", "note"])
