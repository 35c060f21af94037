"""How long a no-op `meshdeploy plan` takes on a converged cluster, and how many remote
commands it runs per host, at 3 and at 24 lab hosts (ratio of the two is the figure that
matters: the machine is shared and noisy).

    sudo .venv/bin/python benchmarks/plan_speed.py [--sizes 3,24] [--runs 5] [--keep-lab]
            [--baseline OTHER_CHECKOUT]

Brings up the lab (name `mdbench`), writes a cluster file (node1 orchestrator, every other
host one CPU rpc-server), converges it with `meshdeploy apply`, then times `plan` in-process
through the same code the CLI runs (benchmarks/plan_once.py); with --baseline, another
checkout's plan alternates with this tree's. Prints one row per size and code.
"""

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from tabulate import tabulate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def cluster_yaml(info, n: int) -> str:
    base = (REPO / "inventories" / "lab.yaml").read_text()
    head = base[:base.index("hosts:")]
    tail = base[base.index("models:"):]
    head = head.replace("http://127.0.0.1:18080", info.mirrors["hf_api_endpoint"])
    hosts = ["hosts:"]
    for i, h in enumerate(info.hosts[:n]):
        hosts += [f"  {h.name}:", f"    address: {h.address}",
                  f"    ssh: {{user: deploy, config: {info.ssh['config']}, sudo: true}}",
                  "    backend: cpu"]
        if i:
            hosts += ["    rpc_servers:", "      - port: 50052"]
    # llama-server takes at most 16 rpc-servers (GGML_RPC_MAX_SERVERS): the rest of the hosts
    # still run a converged rpc-server each, which is what the plan has to check.
    workers = [f"{h.name}:50052" for h in info.hosts[1:n]][:15]
    tail = tail.replace("    host: node1\n", f"    host: node1\n    rpc: [{', '.join(workers)}]\n", 1)
    return head + "\n".join(hosts) + "\n" + tail


def plan_once(path: Path, root: Path) -> tuple[float, dict, bool]:
    """One no-op plan by the meshdeploy importable from `root`, timed inside its process."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "plan_once.py"), str(path)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    if proc.returncode != 0:
        raise SystemExit(f"plan failed ({root}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["seconds"], out["commands"], out["changed"]


def importable(checkout: Path, into: Path) -> Path:
    """A folder from which `import meshdeploy` gets `checkout`'s code, whichever layout it has
    (before the move into meshdeploy/, deploy/ roles/ lab/ schemas/ sat at the top)."""
    package = into / "meshdeploy"
    package.mkdir(parents=True)
    for entry in (checkout / "meshdeploy").iterdir():
        (package / entry.name).symlink_to(entry.resolve())
    for name in ("deploy", "roles", "lab", "schemas"):
        if not (package / name).exists():
            (package / name).symlink_to((checkout / name).resolve())
    return into


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="3,24")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep-lab", action="store_true")
    parser.add_argument("--baseline", type=Path,
                        help="another checkout (e.g. `git worktree add /tmp/base <commit>`): its "
                             "no-op plan is timed too, alternating with this tree's")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    from meshdeploy.lab import Lab

    # One lab of the largest size; smaller clusters use its first hosts (`up` with fewer hosts
    # would remove the others).
    info = Lab(name="mdbench", hosts=max(sizes)).up()
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="md-bench-"))
    trees = [("this tree", REPO)]
    if args.baseline:
        trees.append((f"baseline {args.baseline.name}",
                      importable(args.baseline, workdir / "baseline")))
    try:
        for n in sizes:
            path = workdir / f"bench-{n}.yaml"
            path.write_text(cluster_yaml(info, n))
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "meshdeploy", "apply", str(path),
                                   "--auto-approve"], capture_output=True, text=True)
            converge = time.monotonic() - t0
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                return 1
            times = {label: [] for label, _ in trees}
            commands, changed = {label: {} for label, _ in trees}, {label: False for label, _ in trees}
            for _ in range(args.runs):
                for label, root in trees:  # alternating: both see the same machine load
                    seconds, commands[label], changes = plan_once(path, root)
                    times[label].append(seconds)
                    changed[label] |= changes
            for label, _ in trees:
                per_host = max(commands[label].values())
                rows.append([n, label, f"{converge:.0f}", f"{statistics.median(times[label]):.2f}",
                             f"{min(times[label]):.2f}", per_host,
                             "no" if not changed[label] else "YES"])
                print(f"{n} hosts, {label}: plan median {statistics.median(times[label]):.2f} s, "
                      f"{per_host} remote commands/host", flush=True)
    finally:
        if not args.keep_lab:
            Lab(name="mdbench").down()
    print(tabulate(rows, headers=["hosts", "code", "converge s", "no-op plan median s", "min s",
                                  "remote commands/host", "changes?"]))
    mine = [r for r in rows if r[1] == "this tree"]
    if len(mine) >= 2:
        print(f"ratio {mine[-1][0]} vs {mine[0][0]} hosts: "
              f"{float(mine[-1][3]) / float(mine[0][3]):.2f}x")
    for n in sizes:
        pair = [float(r[3]) for r in rows if r[0] == n]
        if len(pair) == 2:
            print(f"{n} hosts: this tree / baseline = {pair[0] / pair[1]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
