"""How long a no-op `meshdeploy plan` takes on a converged cluster, and how many remote
commands it runs per host, at 3 and at 24 lab hosts (ratio of the two is the figure that
matters: the machine is shared and noisy).

    sudo .venv/bin/python benchmarks/plan_speed.py [--sizes 3,24] [--runs 5] [--keep-lab]

Brings up the lab (name `mdbench`), writes a cluster file (node1 orchestrator, every other
host one CPU rpc-server), converges it with `meshdeploy apply`, then times `plan` in-process
through the same code the CLI runs. Prints one row per size.
"""

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
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


def plan_once(path: Path) -> tuple[float, dict, bool]:
    from meshdeploy.deploy.config import load_cluster
    from meshdeploy.deploy.engine import make_plan
    from meshdeploy.deploy.session import Session

    started = time.monotonic()
    session = Session(load_cluster(path))
    session.open()
    session.connect()
    try:
        planned = make_plan(session)
    finally:
        session.close()
    return time.monotonic() - started, dict(session.commands_run), planned.plan.has_changes()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="3,24")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep-lab", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    from meshdeploy.lab import Lab

    # One lab of the largest size; smaller clusters use its first hosts (`up` with fewer hosts
    # would remove the others).
    info = Lab(name="mdbench", hosts=max(sizes)).up()
    rows = []
    workdir = Path(tempfile.mkdtemp(prefix="md-bench-"))
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
            times, commands, changed = [], {}, False
            for _ in range(args.runs):
                seconds, commands, changes = plan_once(path)
                times.append(seconds)
                changed |= changes
            per_host = max(commands.values())
            rows.append([n, f"{converge:.0f}", f"{statistics.median(times):.2f}",
                         f"{min(times):.2f}", per_host, "no" if not changed else "YES"])
            print(f"{n} hosts: converge {converge:.0f} s, plan median "
                  f"{statistics.median(times):.2f} s, {per_host} remote commands/host",
                  flush=True)
    finally:
        if not args.keep_lab:
            Lab(name="mdbench").down()
    print(tabulate(rows, headers=["hosts", "converge s", "no-op plan median s", "min s",
                                  "remote commands/host", "changes?"]))
    if len(rows) >= 2:
        print(f"ratio {rows[-1][0]} vs {rows[0][0]} hosts: "
              f"{float(rows[-1][2]) / float(rows[0][2]):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
