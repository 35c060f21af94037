"""Placement for speed, measured: the split by memory, a sweep of splits, and placement: auto on
a lab whose workers are equal, then on one whose workers differ in speed.

    sudo .venv/bin/python benchmarks/placement.py [--lab mdpl] [--points 7] [--runs 3]
            [--keep-lab] [--only homogeneous|heterogeneous]

Brings up a lab of its own (node1 orchestrates a synthetic llama of 24 layers of 23 MB over
node2 and node3, GGML_NATIVE=OFF as the converged test lab builds; both rpc-servers on one
thread), then for each of two clusters, the homogeneous one and the heterogeneous one (node3's
rpc-server sharing its core with a busy loop, node2's alone on the other: tests/support/
contention.py):
- converges it with the split by memory and benches it (`meshdeploy bench`);
- sweeps --points splits (`meshdeploy bench --sweep`: each split's tokens/s against the
  prediction fitted on the other splits);
- plans placement: auto, applies it and benches it again.
Prints each sweep and, per cluster, auto / memory, auto / the best split of the sweep, and the
largest prediction error. The targets (issue "Fast, not just up"): heterogeneous auto >= 1.25x
memory, auto within 10% of the sweep's best, every prediction within 25%, homogeneous auto
not slower than memory beyond noise (5%). Figures go to docs/benchmarks.md; nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from meshdeploy.lab import Lab, base, hfstore  # noqa: E402
from support import contention, wire  # noqa: E402
from support.synthetic import Shape, write_llama  # noqa: E402

# 24 layers of 23 MB (f16) and a small output: the layers are what the devices read.
MODEL = Shape(n_layers=24, n_embd=1024, n_ff=2816, n_head=16, n_head_kv=4)
WORKER = "      - {port: 50052, cache: false}\n"


def meshdeploy(*args) -> str:
    proc = subprocess.run([sys.executable, "-m", "meshdeploy", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"meshdeploy {' '.join(map(str, args))} failed:\n{proc.stderr}")
    return proc.stdout


def with_threads(text: str, fast: int, slow: int) -> str:
    first, second, rest = text.split(WORKER, 2)
    one = "      - {port: 50052, cache: false, threads: %d}\n"
    return first + one % fast + second + one % slow + rest


def tg(path: Path, runs: int) -> float:
    (server,) = json.loads(meshdeploy("bench", path, "--runs", runs, "--json"))["servers"]
    return server["overall"]["tg"]["median"]


def layers(path: Path) -> tuple[str, list[int], float | None]:
    (p,) = json.loads(meshdeploy("plan", path, "--json"))["placement"]
    counts = [0 if r["first_layer"] is None else r["last_layer"] - r["first_layer"] + 1
              for r in p["rows"]]
    return p["split_by"], counts, (p["speed"] or {}).get("gen_tps")


def one_cluster(info, folder: Path, name: str, text: str, points: int, runs: int,
                slow: bool) -> dict:
    path = folder / f"{name}.yaml"
    path.write_text(text)
    for lock in folder.glob("*.lock.json"):  # the commit the first cluster resolved
        path.with_name(f"{name}.lock.json").write_text(lock.read_text())
        break
    meshdeploy("apply", path, "--auto-approve")
    if slow:
        contention.slow_down(info, "node2", "node3")
    memory_tps = tg(path, runs)
    swept = json.loads(meshdeploy("bench", path, "--sweep", "--points", points, "--runs", runs,
                                  "--auto-approve", "--json"))
    (server,) = swept["servers"]
    _, memory_layers, memory_predicted = layers(path)
    path.write_text(text.replace("    placement: memory\n", "    placement: auto\n", 1))
    split_by, auto_layers, auto_predicted = layers(path)
    meshdeploy("apply", path, "--auto-approve")
    auto_tps = tg(path, runs)
    return {"name": name, "memory": (memory_layers, memory_tps, memory_predicted),
            "auto": (split_by, auto_layers, auto_tps, auto_predicted), "sweep": server}


def report(r: dict) -> None:
    rows, errors = [], []
    for s in r["sweep"]["splits"]:
        if not s["loaded"]:
            rows.append([",".join(map(str, s["ts"])), " / ".join(map(str, s["layers"])),
                         "not measured", "", ""])
            continue
        measured, predicted = s["measured"]["gen"], (s.get("predicted") or {}).get("gen")
        err = None if predicted is None else (predicted - measured) / measured
        errors += [abs(err)] if err is not None else []
        rows.append([",".join(map(str, s["ts"])), " / ".join(map(str, s["layers"])),
                     f"{measured:.2f}", "n/a" if predicted is None else f"{predicted:.2f}",
                     "n/a" if err is None else f"{100 * err:+.1f}%"])
    print(f"\n== {r['name']}: sweep (predicted from a fit of the other splits)")
    print(tabulate(rows, headers=["-ts", "layers node2 / node3", "tg t/s", "predicted", "error"],
                   disable_numparse=True))
    best = max((s["measured"]["gen"] for s in r["sweep"]["splits"] if s["loaded"]), default=None)
    memory_layers, memory_tps, memory_predicted = r["memory"]
    split_by, auto_layers, auto_tps, auto_predicted = r["auto"]
    print(tabulate([
        ["memory", " / ".join(map(str, memory_layers)), f"{memory_tps:.2f}",
         "n/a" if memory_predicted is None else f"{memory_predicted:.2f}"],
        [f"auto ({split_by})", " / ".join(map(str, auto_layers)), f"{auto_tps:.2f}",
         "n/a" if auto_predicted is None else f"{auto_predicted:.2f}"],
    ], headers=["split", "layers node2 / node3", "tg t/s measured", "tg t/s predicted"],
        disable_numparse=True))
    print(f"auto / memory: {auto_tps / memory_tps:.2f}x; auto / best of sweep: "
          f"{auto_tps / best:.2f}x; largest |prediction error|: "
          f"{100 * max(errors, default=0):.1f}% over {len(errors)} splits")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", default="mdpl")
    parser.add_argument("--points", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep-lab", action="store_true")
    parser.add_argument("--only", choices=("homogeneous", "heterogeneous"),
                        help="run one of the two clusters")
    args = parser.parse_args()
    # SIGTERM (a timeout, `kill`) still takes the lab down in the `finally` below.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    handle = Lab(name=args.lab, hosts=3, toolchain=True)
    info = handle.up()
    try:
        folder = Path(tempfile.mkdtemp(prefix="placement-"))
        model = write_llama(folder / "layers24.gguf", MODEL)
        served = hfstore.add_file(base.cache_root() / "hf", "meshdeploy/synthetic-layers24",
                                   "layers24.gguf", model)
        text = wire.cluster_yaml(info, served["repo"], served["file"], served["sha256"], False,
                                 tensor_split="auto", ctx=4096)
        if "GGML_NATIVE=OFF" not in text:  # inventories/lab.yaml names it itself now
            text = text.replace("  build:\n", "  build:\n    cmake_flags: [-DGGML_NATIVE=OFF]\n",
                                1)
        text = with_threads(text, 1, 1).replace(
            "    model: synthetic\n", "    model: synthetic\n    placement: memory\n", 1)
        # Each cluster is reported as soon as it is measured: a run cut short keeps the first.
        if args.only != "heterogeneous":
            report(one_cluster(info, folder, "homogeneous", text, args.points, args.runs, False))
            sys.stdout.flush()
        if args.only != "homogeneous":
            try:
                report(one_cluster(info, folder, "heterogeneous", text, args.points, args.runs,
                                   True))
            finally:
                contention.release(info, "node3")
    finally:
        if not args.keep_lab:
            handle.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
