"""What `meshdeploy bench` measured, as one structure: the ratio to a local run, the change since
the last bench, and the two views (text, JSON) of it. Pure: the measuring and the statistics over
llama-server's own `timings` are meshdeploy.engine.server_api's.

The last result of each server is kept in `<cluster-file-stem>.bench.json` beside the cluster
file (and its lock file), until a state file next to the lock takes it over.
"""

from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

from meshdeploy.core.files import write_atomic
from meshdeploy.engine.server_api import METRICS
from meshdeploy.errors import terminal_text

FORMAT_VERSION = 1
STATE_SUFFIX = ".bench.json"


def ratio(numerator: dict, denominator: dict) -> dict:
    """Median over median for each metric ({"pp": 0.93, "tg": 0.71}); None where undefined."""
    out = {}
    for metric, _, _ in METRICS:
        a, b = numerator[metric]["median"], denominator[metric]["median"]
        out[metric] = round(a / b, 3) if b else None
    return out


def change(current: dict, previous: dict | None) -> dict | None:
    """The current bench against the kept one: ratios overall and per prompt present in both."""
    if not previous or "overall" not in previous:
        return None
    try:
        prompts = {}
        before = {p["prompt"]: p for p in previous.get("prompts", [])}
        for row in current["prompts"]:
            if row["prompt"] in before:
                prompts[row["prompt"]] = ratio(row, before[row["prompt"]])
        return {"since": previous.get("time"), "build": previous.get("build"),
                "model": previous.get("model"),
                "overall": ratio(current["overall"], previous["overall"]), "prompts": prompts}
    except (KeyError, TypeError):
        return None  # a kept result of another shape: nothing to compare with


# -- the kept result -----------------------------------------------------------------------------

def state_path(cluster_path: Path) -> Path:
    return cluster_path.with_name(cluster_path.stem + STATE_SUFFIX)


def read_state(cluster_path: Path) -> dict:
    """{server name: kept result}; {} when there is none or it cannot be read."""
    try:
        data = json.loads(state_path(cluster_path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        return {}
    servers = data.get("servers")
    return servers if isinstance(servers, dict) else {}


def kept(result: dict) -> dict:
    """What of a server's result the state keeps: enough to compare the next bench with."""
    return {k: result[k] for k in ("time", "host", "model", "build", "params", "prompts",
                                   "overall") if k in result}


def write_state(cluster_path: Path, results: list[dict]) -> Path:
    """Replace the kept result of each benched server (others stay); atomic, never through a
    planted link."""
    path = state_path(cluster_path)
    servers = read_state(cluster_path)
    for result in results:
        servers[result["server"]] = kept(result)
    write_atomic(path, json.dumps({"format_version": FORMAT_VERSION, "servers": servers},
                                  indent=2, sort_keys=True) + "\n", 0o644)
    return path


# -- views ---------------------------------------------------------------------------------------

def render_json(cluster_name: str, results: list[dict], state: str | None) -> str:
    return json.dumps({"format_version": FORMAT_VERSION, "cluster": cluster_name,
                       "servers": results, "state_file": state}, indent=2, sort_keys=True)


def _cell(s: dict) -> str:
    return f"{s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f}"


def _table(summary: dict) -> str:
    rows = [[p["prompt"], p["prompt_n"], p["predicted_n"], _cell(p["pp"]), _cell(p["tg"])]
            for p in summary["prompts"]]
    o = summary["overall"]
    rows.append(["all", o["prompt_n"], o["predicted_n"], _cell(o["pp"]), _cell(o["tg"])])
    return tabulate(rows, headers=["prompt", "tokens in", "tokens out",
                                   "pp t/s min / median / max", "tg t/s min / median / max"],
                    disable_numparse=True)


def _ratios(r: dict) -> str:
    return ", ".join(f"{m} {r[m]:.2f}x" if r.get(m) is not None else f"{m} n/a"
                     for m, _, _ in METRICS)


def _build(build) -> str:
    if not build or not isinstance(build, dict):  # the kept one is the bench file's to say
        return "build unknown"
    commit = (build.get("commit") or "")[:12]
    info = build.get("info") or ""
    return "build " + (f"{info} (commit {commit})" if info and commit else info or commit)


def render_text(results: list[dict], kept: str | None = None) -> str:
    """Each server's result; then, given `kept`, where the result was kept. Inert for the
    terminal (terminal_text): the build's text is the server's answer, and the earlier result
    the bench file's, which whoever can write the cluster file's folder writes."""
    out = []
    for r in results:
        p = r["params"]
        out.append(f"llama-server {r['server']} on {r['host']}: model {r['model']}, "
                   f"{_build(r.get('build'))}\n{p['runs']} runs after {p['warmup']} warm-up, "
                   f"{p['n_predict']} tokens generated per prompt, temperature 0, "
                   "prompt cache off\n")
        out.append(_table(r))
        local = r.get("local")
        if local and local.get("skipped"):
            out.append(f"\nLocal comparison skipped: {local['skipped']}")
        elif local:
            out.append(f"\nThe same build and model on {r['host']} alone (port {local['port']}, "
                       f"{local['fits']}):\n")
            out.append(_table(local))
            out.append(f"\ncluster / local: {_ratios(r['ratio_to_local'])}")
        ch = r.get("change")
        if ch:
            since = f" ({ch['since']}" + (f", {_build(ch['build'])}" if ch.get("build") else "")
            since += f", model {ch['model']})" if ch.get("model") else ")"
            out.append(f"\nChange since the last bench{since}: {_ratios(ch['overall'])}")
        else:
            out.append("\nNo earlier bench of this server to compare with.")
        out.append("")
    text = "\n".join(out).rstrip() + "\n"
    return terminal_text(text if kept is None else text + f"\nKept as the last result in {kept}")
