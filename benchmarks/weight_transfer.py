"""Weight bytes on the wire and time to first /health 200: stock vs pre-seeded rpc caches.

Usage (root, on a machine that can run the lab; takes ~10 minutes, ~9 GB of disk):
    .venv/bin/python benchmarks/weight_transfer.py [--lab mdzero] [--rates 100mbit,1gbit]
            [--runs 1] [--keep-lab]

Brings lab `--lab` up (3 hosts), writes a ~2.1 GB synthetic llama GGUF, deploys it through
node2 + node3 with meshdeploy (stock: cache false; seeded: cache true), shapes the bridge ->
worker links with tc tbf, restarts llama-server and measures. Local-only (llama-server on node1
with no RPC) is the floor. Prints a Markdown table; the lab is taken down unless --keep-lab.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshdeploy.lab import Lab, LabInfo, base, hfstore
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import wire  # noqa: E402
from support.synthetic import LARGE, write_llama  # noqa: E402

WORKERS = ("node2", "node3")


def meshdeploy(*args) -> str:
    proc = subprocess.run([sys.executable, "-m", "meshdeploy", *map(str, args)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        sys.exit(f"meshdeploy {' '.join(map(str, args))} failed:\n{proc.stdout[-3000:]}\n"
                 f"{proc.stderr[-3000:]}")
    return proc.stdout


def measure(info, rate: str | None, runs: int) -> list[dict]:
    out = []
    with wire.shaped(info.name, WORKERS, rate):
        for _ in range(runs):
            before = {h: wire.tx_bytes(info.name, h) for h in WORKERS}
            seconds = wire.restart_server(info)
            sent = sum(wire.tx_bytes(info.name, h) - before[h] for h in WORKERS)
            out.append({"seconds": seconds, "sent": sent, "text": wire.complete(info)})
    return out


def local_only(info, model_path: str) -> float:
    """llama-server on node1 alone (no --rpc): the floor of any start."""
    script = ("B=$(readlink -f /opt/meshdeploy/current)/bin/llama-server; "
              f"$B -m {model_path} --host 127.0.0.1 --port 8099 -c 512 >/tmp/local.log 2>&1 & "
              "P=$!; s=$(date +%s.%N); for i in $(seq 6000); do "
              "c=$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8099/health); "
              "[ \"$c\" = 200 ] && break; sleep 0.05; done; e=$(date +%s.%N); "
              "kill $P; wait $P 2>/dev/null; echo \"ready $s $e $c\"")
    proc = info.run("node1", script, timeout=600)
    m = re.search(r"ready ([\d.]+) ([\d.]+) 200", proc.stdout)
    if not m:
        sys.exit(f"local-only llama-server never became healthy: {proc.stdout} {proc.stderr}")
    return float(m.group(2)) - float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lab", default="mdzero")
    ap.add_argument("--rates", default="100mbit,1gbit")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--keep-lab", action="store_true")
    args = ap.parse_args()
    lab = Lab(name=args.lab)
    lab.up()
    info = LabInfo.load(lab.state_dir)
    work = Path(tempfile.mkdtemp(prefix="meshdeploy-bench-"))
    try:
        t0 = time.monotonic()
        model = write_llama(work / "synthetic-2g.gguf", LARGE)
        served = hfstore.add_file(base.cache_root() / "hf", "meshdeploy/synthetic-llama-2g",
                                   "synthetic-2g.gguf", model)
        print(f"model: {served['size'] / 1e9:.2f} GB, written and served in "
              f"{time.monotonic() - t0:.1f} s", flush=True)
        rates = [r for r in args.rates.split(",") if r]
        rows, texts = [], set()
        for cache in (False, True):
            cluster = work / ("seeded" if cache else "stock") / "bench.yaml"
            cluster.parent.mkdir()
            cluster.write_text(wire.cluster_yaml(info, served["repo"], served["file"],
                                                 served["sha256"], cache))
            out = meshdeploy("apply", cluster, "--auto-approve")
            if cache:
                seed = [float(m) for m in re.findall(
                    r"^\s+node\d\s+rpc_cache\.seed\[50052\]\s+ok \(([\d.]+) s\)", out, re.M)]
                print(out[out.find("Placement of"):out.find("Plan:")], flush=True)
                print(f"seeding (hash + write) per worker: {seed} s", flush=True)
            for rate in rates:
                for r in measure(info, rate, args.runs):
                    rows.append(("seeded" if cache else "stock", rate, r["sent"], r["seconds"]))
                    texts.add(r["text"])
                    print(rows[-1], flush=True)
        floor = local_only(info, "/opt/meshdeploy/models/synthetic/synthetic-2g.gguf")
        print("\n| mode | link | weight bytes sent to workers (MB) | time to /health 200 (s) |")
        print("|---|---|---:|---:|")
        for mode, rate, sent, secs in rows:
            print(f"| {mode} | {rate} | {sent / 1e6:,.1f} | {secs:.2f} |")
        print(f"| local-only (node1, no RPC) | - | 0 | {floor:.2f} |")
        print(f"\ngreedy outputs identical across all runs: {len(texts) == 1}")
    finally:
        if not args.keep_lab:
            lab.down()


if __name__ == "__main__":
    main()
