"""What `meshdeploy bench --sweep` says: the notice before it stops anything, and its result
per server, as text and as JSON of the same structure. Pure: the measuring is
meshdeploy.engine.sweep.

A server's result: {"server", "host", "model", "build", "devices", "params", "time",
"splits": [{"ts", "layers", "placement", "held_bytes", "loaded", "error" | "measured",
"predicted"}], "calibration" | "fit_error" | "skipped", "kept"}. "measured" and "predicted"
are tokens per second, {"gen": ..., "prompt": ...}; a prediction comes from a fit of the other
splits only. "calibration" is placement.speed.Calibration.to_json(): seconds per byte.
"""

from __future__ import annotations

import json

from tabulate import tabulate

from meshdeploy.errors import terminal_text

FORMAT_VERSION = 1


def render_notice(swept, skipped: list[dict]) -> str:
    """What the sweep will interrupt, before anything is stopped, and whom it leaves out."""
    lines = [f"bench --sweep stops llama-server {s.name} on {s.host} for the sweep; starts it "
             "again afterwards" for s in swept]
    return "\n".join(lines + [_skipped(r) for r in skipped])


def _skipped(r: dict) -> str:
    return f"llama-server {r['server']} on {r['host']}: skipped, {r['skipped']}"


def render_json(cluster_name: str, results: list[dict], speed_file: str) -> str:
    return json.dumps({"format_version": FORMAT_VERSION, "cluster": cluster_name,
                       "servers": results, "speed_file": speed_file}, indent=2, sort_keys=True)


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def error(measured: float, predicted: float | None) -> str:
    """The prediction's error against the measurement, in percent of the measurement."""
    if predicted is None or not measured:
        return "n/a"
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def _table(splits: list[dict]) -> str:
    rows = []
    for s in splits:
        head = [",".join(str(v) for v in s["ts"]), " / ".join(str(n) for n in s["layers"])]
        if not s["loaded"]:
            rows.append(head + ["not measured"] + [""] * 5)
            continue
        m, p = s["measured"], s.get("predicted") or {}
        rows.append(head + [_rate(m["gen"]), _rate(p.get("gen")), error(m["gen"], p.get("gen")),
                            _rate(m["prompt"]), _rate(p.get("prompt")),
                            error(m["prompt"], p.get("prompt"))])
    return tabulate(rows, headers=["split (-ts)", "layers", "tg t/s", "tg predicted", "error",
                                   "pp t/s", "pp predicted", "error"], disable_numparse=True)


def _per_gb(devices: list[str], calibration: dict) -> str:
    prompt = calibration.get("prompt") or [None] * len(devices)
    rtt = calibration.get("rtt") or [None] * len(devices)
    rows = [[d, f"{g * 1e9:.4g}", "n/a" if q is None else f"{q * 1e9:.4g}",
             # 0: a local device, or a worker whose round trip was not timed
             "n/a" if r is None else ("-" if r == 0 else f"{r * 1e3:.3f}")]
            for d, g, q, r in zip(devices, calibration["gen"], prompt, rtt)]
    return tabulate(rows, headers=["device", "generation s/GB", "prompt s/GB per token",
                                   "round trip ms"], disable_numparse=True)


def best(splits: list[dict]) -> dict | None:
    """The loaded split with the highest measured generation rate."""
    loaded = [s for s in splits if s["loaded"]]
    return max(loaded, key=lambda s: s["measured"]["gen"]) if loaded else None


def _server(r: dict) -> list[str]:
    if "skipped" in r:
        return [_skipped(r)]
    p = r["params"]
    loaded = sum(s["loaded"] for s in r["splits"])
    out = [f"llama-server {r['server']} on {r['host']}: model {r['model']}, "
           f"{loaded} of {len(r['splits'])} splits loaded, {p['runs']} runs each\n"
           f"devices: {', '.join(r['devices'])}; predicted = fitted on the other splits only\n",
           _table(r["splits"])]
    failed = [s for s in r["splits"] if not s["loaded"]]
    out += [f"-ts {','.join(str(v) for v in s['ts'])} not measured: {s['error']}" for s in failed]
    top = best(r["splits"])
    if top is not None:
        out.append(f"\nBest measured split: -ts {','.join(str(v) for v in top['ts'])} "
                   f"({top['placement']}), tg {top['measured']['gen']:.1f} t/s")
    alone = r.get("alone") or {}
    if "gen" in alone:
        out.append(f"On {r['host']} alone, without workers: tg {alone['gen']:.1f} t/s, "
                   f"pp {alone['prompt']:.1f} t/s")
    elif "skipped" in alone:
        out.append(f"On {r['host']} alone: not measured ({alone['skipped']})")
    if "fit_error" in r:
        out.append(f"No speeds kept: {r['fit_error']}")
        return out
    out.append(f"\nSeconds per GB each device reads, fitted on all {loaded} loaded splits:\n")
    out.append(_per_gb(r["devices"], r["calibration"]))
    out.append(f"\nKept in {r['kept']}: placement: auto uses it while the devices, the build "
               "and the model stay the same.")
    return out


def render_text(results: list[dict]) -> str:
    """The results for a person; what hosts and files said in them (a split's error, a
    skip's reason) is shown, never run by the terminal (errors.terminal_text)."""
    out = []
    for r in results:
        out += _server(r) + [""]
    return terminal_text("\n".join(out).rstrip() + "\n")
