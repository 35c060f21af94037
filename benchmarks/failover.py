"""Failover, measured: how long a cluster serves nothing when a worker's link drops silently,
how long it takes to go back to the full placement when the link returns, and how many
requests of a steady loop fail while one worker flaps.

    sudo .venv/bin/python benchmarks/failover.py [--lab mdfb] [--model gemma|synthetic]
            [--cycles 5] [--away 60] [--back 60] [--keep-lab]

Brings up a lab of its own (node1 orchestrates, node2 and node3 one cached rpc-server each)
and converges inventories/lab.yaml on it with gemma-3-270m, or with the ~2.1 GB synthetic
llama (tests/support/synthetic.py LARGE, split [1, 1]); servers.main.failover is the default
(tolerate 1, seeded). A loop on the control machine asks node1's llama-server for one short
completion after another (inside node1's network namespace, 60 s timeout each). Then:
- one silent loss: node3's traffic with node1 dropped both ways in node3's namespace (nftables,
  no RST); measured: the loss to md-failover's switch (its state file names node3), the loss to
  the first completion answered after it; then the link back, to the full placement;
- `--cycles` flaps of node3 (`--away` s away, `--back` s back): requests asked and failed
  while away, while back, and those a return cut (in flight when md-failover restarted
  llama-server) or refused (asked while the full placement loaded).
The targets (issue "Hosts come and go"): detection within 6 s of a silent loss; serving again
within detection + the degraded placement's load + 5 s; no request failed by the return.
Prints the figures; nothing here asserts. The nft table is always removed; the lab is taken
down unless --keep-lab.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from meshdeploy.lab import Lab, base, hfstore, net  # noqa: E402
from support.labfile import lab_text  # noqa: E402
from support.synthetic import LARGE, write_llama  # noqa: E402
from support import wire  # noqa: E402

STATE = "/run/meshdeploy-server-main/failover.json"
TABLE = "mdbench_failover"


def meshdeploy(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshdeploy", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO)


def state(info) -> dict:
    done = info.run("node1", f"sudo -n cat {STATE}")
    try:
        return json.loads(done.stdout)
    except ValueError:
        return {}


def wait_state(info, predicate, timeout: float = 300, step: float = 0.25) -> float | None:
    """Seconds until md-failover's state matches `predicate`; None when it never did."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        s = state(info)
        if s and predicate(s):
            return time.monotonic() - started
        time.sleep(step)
    return None


def cut(info, host: str, on: bool) -> None:
    ns = net.host_netns(info.name, host)
    peer = info.host("node1").address
    rules = (f"table inet {TABLE} {{\n"
             f"  chain i {{ type filter hook input priority -10; ip saddr {peer} drop; }}\n"
             f"  chain o {{ type filter hook output priority -10; ip daddr {peer} drop; }}\n}}\n"
             if on else f"delete table inet {TABLE}\n")
    subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, text=True,
                   capture_output=True, check=on, timeout=30)


class Loop:
    """Completions one after another: (asked, answered, ok) each."""

    def __init__(self, info):
        self.ns = net.host_netns(info.name, "node1")
        self.results: list[tuple[float, float, bool]] = []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        body = json.dumps({"prompt": "The capital of France is", "n_predict": 8,
                           "temperature": 0})
        while self.running:
            asked = time.monotonic()
            done = subprocess.run(["ip", "netns", "exec", self.ns, "curl", "-sf", "-m", "60",
                                   "-H", "Content-Type: application/json", "-d", body,
                                   "http://127.0.0.1:8080/completion"],
                                  capture_output=True, text=True)
            ok = done.returncode == 0 and '"content"' in done.stdout
            self.results.append((asked, time.monotonic(), ok))
            if not ok:
                time.sleep(0.2)

    def stop(self):
        self.running = False
        self.thread.join(90)

    def between(self, start: float, end: float) -> list[tuple[float, float, bool]]:
        return [r for r in self.results if start <= r[0] < end]


def cluster_text(info, model: str, folder: Path) -> str:
    if model == "gemma":
        return lab_text(info).replace("      - port: 50052\n",
                                      "      - {port: 50052, cache: true}\n")
    path = write_llama(folder / "synthetic-2g.gguf", LARGE)
    served = hfstore.add_file(base.cache_root() / "hf", "meshdeploy/synthetic-llama-2g",
                               "synthetic-2g.gguf", path)
    return wire.cluster_yaml(info, served["repo"], served["file"], served["sha256"], True,
                             tensor_split="[1, 1]", ctx=512)


def one_loss(info, loop: Loop) -> dict:
    wait_state(info, lambda s: s.get("state") == "serving" and not s["lost"])
    time.sleep(5)
    t0, wall = time.monotonic(), time.time()
    cut(info, "node3", True)
    try:
        detect = wait_state(info, lambda s: s["lost"] == ["node3"])
        start = time.monotonic()
        while time.monotonic() - start < 300 and not any(
                ok for _, end, ok in loop.results if end > t0 and ok and _ > t0):
            time.sleep(0.2)
        served = min((end for asked, end, ok in loop.results if ok and asked > t0),
                     default=None)
    finally:
        cut(info, "node3", False)
    t1 = time.monotonic()
    full = wait_state(info, lambda s: s.get("state") == "serving" and not s["lost"])
    return {"detect_s": detect, "serving_again_s": None if served is None else served - t0,
            "back_to_full_s": full, "back_at": t1, "log": failover_log(info, wall)}


def failover_log(info, since: float) -> list[str]:
    """md-failover's lines in node1's journal since `since` (epoch seconds), each with its time
    after that: which way it learned of the loss (its watcher, "lost node3: ...", or
    llama-server's exit) and when it started the next placement."""
    done = info.run("node1", "sudo -n journalctl -u meshdeploy-server-main --no-pager "
                             f"-o short-unix --since @{since:.3f}")
    out = []
    for line in done.stdout.splitlines():
        stamp, _, rest = line.partition(" ")
        if "md-failover: " in rest:
            try:
                at = float(stamp) - since
            except ValueError:
                continue
            out.append(f"  +{at:5.1f} s  {rest.split('md-failover: ', 1)[1]}")
    return out


def flaps(info, loop: Loop, cycles: int, away: float, back: float) -> list[dict]:
    out = []
    for _ in range(cycles):
        t0 = time.monotonic()
        cut(info, "node3", True)
        try:
            time.sleep(away)
        finally:
            cut(info, "node3", False)
        t1 = time.monotonic()
        # The return: md-failover restarts llama-server on the full placement.
        full = wait_state(info, lambda s: s.get("state") == "serving" and not s["lost"],
                          timeout=back + 120)
        switched = t1 + (full or 0)
        time.sleep(max(0.0, back - (time.monotonic() - t1)))
        t2 = time.monotonic()
        away_rows, back_rows = loop.between(t0, t1), loop.between(t1, t2)
        out.append({
            "away asked": len(away_rows), "away failed": sum(not ok for *_, ok in away_rows),
            "back asked": len(back_rows), "back failed": sum(not ok for *_, ok in back_rows),
            # In flight when the full placement took over (asked before, answered after).
            "cut by the return": sum(1 for a, e, ok in loop.results
                                     if not ok and a < switched <= e),
            "refused while it loaded": sum(1 for a, e, ok in back_rows
                                           if not ok and a >= switched),
            "to full s": full})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", default="mdfb")
    parser.add_argument("--model", choices=("gemma", "synthetic"), default="gemma")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--away", type=float, default=60)
    parser.add_argument("--back", type=float, default=60)
    parser.add_argument("--keep-lab", action="store_true")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    handle = Lab(name=args.lab, hosts=3, toolchain=True)
    info = handle.up()
    try:
        folder = Path(tempfile.mkdtemp(prefix="failover-"))
        path = folder / "cluster.yaml"
        path.write_text(cluster_text(info, args.model, folder))
        started = time.monotonic()
        applied = meshdeploy("apply", path, "--auto-approve")
        if applied.returncode != 0:
            sys.exit(f"apply failed:\n{applied.stdout[-3000:]}\n{applied.stderr[-3000:]}")
        print(f"apply: {time.monotonic() - started:.0f} s ({args.model})")
        loop = Loop(info)
        try:
            loss = one_loss(info, loop)
            print(f"silent loss of node3: switch after {loss['detect_s']:.1f} s, first completion "
                  f"answered {loss['serving_again_s']:.1f} s after the loss; link back: full "
                  f"placement after {loss['back_to_full_s']:.1f} s")
            print("md-failover's log from the cut on:", *loss["log"], sep="\n")
            rows = flaps(info, loop, args.cycles, args.away, args.back)
        finally:
            loop.stop()
        from tabulate import tabulate
        print(tabulate(rows, headers="keys", floatfmt=".1f"))
        total = sum(r["away asked"] + r["back asked"] for r in rows)
        failed = sum(r["away failed"] + r["back failed"] for r in rows)
        print(f"{failed} of {total} requests failed over {args.cycles} flaps "
              f"({args.away:g} s away, {args.back:g} s back)")
    finally:
        if not args.keep_lab:
            handle.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
