"""What network.transport: wireguard costs: time to first /health 200, generation tok/s, bytes on
the wire and CPU per GB moved, plain vs wireguard-go, on gemma-3-270m and a ~2.1 GB synthetic
llama GGUF, with the bridge -> worker links shaped to one rate.

Usage (root, on a machine that can run the lab; ~20-30 minutes on 2 cores, ~9 GB of disk):
    .venv/bin/python benchmarks/wireguard_cost.py [--lab mdwgb] [--rate 1gbit] [--runs 3]
            [--models gemma,synthetic] [--n-predict 32] [--keep-lab]

Brings lab `--lab` up (3 hosts), deploys each model through node2 + node3 (rpc caches seeded)
with inventories/lab.yaml's settings, once per transport, and for each restarts node1's
llama-server `--runs` times. Per run: seconds until /health 200; bytes the bridge sent to the
workers (veth tx counters: weights, hashes, WireGuard overhead); CPU seconds (utime + stime from
/proc/<pid>/stat) of llama-server, the rpc-servers and wireguard-go on all three hosts from the
restart to /health 200; then tokens/s of one greedy completion of `--n-predict` tokens, as
llama-server's own timings report it (predicted_per_second). Prints a Markdown table; the lab
is taken down unless --keep-lab.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from meshdeploy.lab import Lab, LabInfo, base, hfstore
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import wire  # noqa: E402
from support.synthetic import LARGE, write_llama  # noqa: E402
from weight_transfer import meshdeploy  # noqa: E402  (this script's folder is on sys.path)

REPO = Path(__file__).resolve().parent.parent
WORKERS = ("node2", "node3")
HOSTS = ("node1",) + WORKERS
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
# Runs as root on a host: utime + stime (clock ticks) of the processes that carry RPC.
CPU = r"""
import json, os
ticks = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        continue
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    if comm in ("llama-server", "ggml-rpc-server", "rpc-server", "wireguard-go"):
        fields = stat[stat.rindex(")") + 2:].split()
        ticks[pid] = [comm, int(fields[11]) + int(fields[12])]
print(json.dumps({"hz": os.sysconf("SC_CLK_TCK"), "ticks": ticks}))
"""


def cluster_text(info, model: dict | None, transport: str) -> str:
    """inventories/lab.yaml for lab `info` (gemma), or wire.cluster_yaml's synthetic model; the
    transport set in network:."""
    if model is None:
        text = (REPO / "inventories" / "lab.yaml").read_text()
        text = text.replace("http://127.0.0.1:18080", info.mirrors["hf_api_endpoint"])
        text = text.replace("/var/lib/meshdeploy/lab/mdlab/ssh_config", info.ssh["config"])
    else:
        text = wire.cluster_yaml(info, model["repo"], model["file"], model["sha256"], cache=True)
    assert "\nnetwork:\n" in text
    return text.replace("\nnetwork:\n", f"\nnetwork:\n  transport: {transport}\n", 1)


def cpu_snapshot(info) -> dict:
    """{(host, pid): (comm, seconds)} of the RPC processes on every host."""
    out = {}
    for host in HOSTS:
        proc = info.run(host, "sudo python3 -c " + shlex.quote(CPU))
        doc = json.loads(proc.stdout)
        for pid, (comm, ticks) in doc["ticks"].items():
            out[(host, pid)] = (comm, ticks / doc["hz"])
    return out


def cpu_delta(before: dict, after: dict) -> dict:
    """CPU seconds per process name spent between two snapshots (new processes count whole)."""
    spent: dict = {}
    for key, (comm, seconds) in after.items():
        spent[comm] = spent.get(comm, 0.0) + seconds - before.get(key, (comm, 0.0))[1]
    return spent


def generate(info, n_predict: int) -> float:
    """Tokens/s of one greedy completion, from llama-server's own timings."""
    body = json.dumps({"prompt": PROMPT, "n_predict": n_predict, "temperature": 0, "seed": 42,
                       "cache_prompt": False, "ignore_eos": True})
    proc = info.run("node1", "curl -s --max-time 900 http://127.0.0.1:8080/completion "
                             f"-H 'Content-Type: application/json' -d '{body}'", timeout=960)
    try:
        timings = json.loads(proc.stdout)["timings"]
    except (ValueError, KeyError):
        sys.exit(f"no completion from llama-server: {proc.stdout[-300:]} {proc.stderr[-300:]}")
    if timings.get("predicted_n") != n_predict:
        sys.exit(f"asked for {n_predict} tokens, llama-server made {timings.get('predicted_n')}")
    return float(timings["predicted_per_second"])


def measure(info, rate: str, runs: int, n_predict: int) -> list[dict]:
    out = []
    with wire.shaped(info.name, WORKERS, rate):
        for _ in range(runs):
            sent = {h: wire.tx_bytes(info.name, h) for h in WORKERS}
            cpu = cpu_snapshot(info)
            seconds = wire.restart_server(info)
            spent = cpu_delta(cpu, cpu_snapshot(info))
            moved = sum(wire.tx_bytes(info.name, h) - sent[h] for h in WORKERS)
            out.append({"ready_s": seconds, "moved": moved, "cpu": spent,
                        "tok_s": generate(info, n_predict)})
            print(f"  {out[-1]}", flush=True)
    return out


def row(model: str, transport: str, runs: list[dict]) -> dict:
    cpu = sum(sum(r["cpu"].values()) for r in runs) / len(runs)
    moved = statistics.median(r["moved"] for r in runs)
    return {"model": model, "transport": transport,
            "ready_s": statistics.median(r["ready_s"] for r in runs),
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "moved_mb": moved / 1e6, "cpu_s": cpu,
            "cpu_per_gb": cpu / (moved / 1e9) if moved else float("nan"),
            "wg_cpu_s": sum(r["cpu"].get("wireguard-go", 0.0) for r in runs) / len(runs)}


def table(rows: list[dict], rate: str, runs: int) -> str:
    lines = [f"| model | transport | time to /health 200 (s, median of {runs}) | generation "
             "tok/s (median) | MB to workers per load | CPU s per load (all RPC processes) | "
             "of which wireguard-go | CPU s per GB moved |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['transport']} | {r['ready_s']:.2f} | "
                     f"{r['tok_s']:.1f} | {r['moved_mb']:,.1f} | {r['cpu_s']:.1f} | "
                     f"{r['wg_cpu_s']:.1f} | {r['cpu_per_gb']:.1f} |")
    by = {(r["model"], r["transport"]): r for r in rows}
    for model in dict.fromkeys(r["model"] for r in rows):
        plain, wg = by.get((model, "plain")), by.get((model, "wireguard"))
        if plain and wg:
            tok = (wg["tok_s"] / plain["tok_s"] - 1) * 100
            ready = (wg["ready_s"] / plain["ready_s"] - 1) * 100
            lines.append(f"\n{model} at {rate}, wireguard-go vs plain: tok/s {tok:+.1f}% "
                         f"(target: no worse than -10%), time to ready {ready:+.1f}% "
                         "(target: no worse than +15%)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lab", default="mdwgb")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--models", default="gemma,synthetic")
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--keep-lab", action="store_true")
    args = ap.parse_args()
    lab = Lab(name=args.lab)
    started = time.monotonic()
    lab.up()
    info = LabInfo.load(lab.state_dir)
    work = Path(tempfile.mkdtemp(prefix="meshdeploy-wgcost-"))
    rows = []
    try:
        # Order: one model switch (the 2 GB download happens once), transports alternating.
        plan = {"gemma": ("plain", "wireguard"), "synthetic": ("wireguard", "plain")}
        for model in [m for m in args.models.split(",") if m]:
            served = None
            if model == "synthetic":
                gguf = write_llama(work / "synthetic-2g.gguf", LARGE)
                served = hfstore.add_file(base.cache_root() / "hf",
                                           "meshdeploy/synthetic-llama-2g", "synthetic-2g.gguf",
                                           gguf)
                print(f"synthetic model: {served['size'] / 1e9:.2f} GB", flush=True)
            for transport in plan[model]:
                cluster = work / f"{model}-{transport}" / "bench.yaml"
                cluster.parent.mkdir()
                cluster.write_text(cluster_text(info, served, transport))
                t0 = time.monotonic()
                meshdeploy("apply", cluster, "--auto-approve")
                print(f"{model} {transport}: applied in {time.monotonic() - t0:.0f} s",
                      flush=True)
                rows.append(row(model, transport, measure(info, args.rate, args.runs,
                                                          args.n_predict)))
        print()
        print(table(rows, args.rate, args.runs))
        print(f"\nlinks bridge -> worker shaped to {args.rate} (tc tbf); total "
              f"{(time.monotonic() - started) / 60:.1f} min")
    finally:
        if not args.keep_lab:
            lab.down()


if __name__ == "__main__":
    main()
