"""The deployed cluster against the same llama.cpp started by hand on the same hosts with the same
flags: is what meshdeploy deploys (hardened systemd units, DynamicUser, firewall) as fast as a
hand-started cluster? Target: deployed / hand >= 0.95 for prompt processing and generation.

    sudo .venv/bin/python benchmarks/bench_vs_hand.py [--lab mdbn] [--runs 3] [--rounds 2]
            [--keep-lab]

Brings up the lab (3 hosts: node1 orchestrator, node2 and node3 CPU workers), converges
inventories/lab.yaml on it with `meshdeploy apply`, then alternates `rounds` times:
- deployed: `meshdeploy bench`'s own code (meshdeploy.commands.bench.bench_server) on the units;
- by hand: the units stopped, ggml-rpc-server and llama-server started as root with the argv
  (and LLAMA_CACHE) the units' processes ran with, read from /proc/<MainPID>/cmdline, benched
  through the same code, killed, and the units started again.
Prints min/median/max of each and the ratio of the medians.
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
sys.path.insert(0, str(REPO))

from meshdeploy.commands import bench  # noqa: E402
from meshdeploy.core.loading import load_cluster  # noqa: E402
from meshdeploy.core import shell
from meshdeploy.lab import Lab  # noqa: E402
from meshdeploy.remote import ssh_settings


def sh(info, host: str, command: str) -> str:
    proc = info.run(host, command, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"{host}: {command!r} failed: {proc.stderr.strip()}")
    return proc.stdout


def process_of(info, host: str, unit: str) -> tuple[list[str], dict]:
    """argv and environment of a unit's running process."""
    pid = sh(info, host, shell.command("systemctl", "show", "-p", "MainPID", "--value", unit))
    pid = pid.strip()
    argv = sh(info, host, shell.command("sudo", "-n", "cat", f"/proc/{pid}/cmdline")).split("\0")
    env = sh(info, host, shell.command("sudo", "-n", "cat", f"/proc/{pid}/environ")).split("\0")
    keep = dict(e.split("=", 1) for e in env if e.startswith("LLAMA_CACHE="))
    return [a for a in argv if a], keep


def start_by_hand(info, host: str, argv: list[str], env: dict, log: str) -> None:
    """argv as root in the background, detached from the SSH session; its pid in log.pid."""
    words = ["env", *(f"{k}={v}" for k, v in env.items()), *argv]
    body = 'setsid "$@" > "$LOG" 2>&1 < /dev/null & echo $! > "$LOG.pid"'
    sh(info, host, shell.sudo(shell.script(body, args=words, LOG=log)))


def stop_by_hand(info, host: str, log: str) -> None:
    # Gone before the unit starts again on the same port.
    body = ('[ -f "$LOG.pid" ] || exit 0; p=$(cat "$LOG.pid"); kill "$p" 2>/dev/null; '
            'for i in $(seq 50); do [ -d "/proc/$p" ] || break; sleep 0.2; done; rm -f "$LOG.pid"')
    sh(info, host, shell.sudo(shell.script(body, LOG=log)))


def wait_listening(info, host: str, address: str, port: int) -> None:
    for _ in range(120):
        probe = info.run(host, f"timeout 2 bash -c 'exec 3<>/dev/tcp/{address}/{port}'")
        if probe.returncode == 0:
            return
        time.sleep(0.5)
    raise SystemExit(f"{host}: nothing listens on {address}:{port}")


def measure(cluster, server, runs: int) -> dict:
    settings = ssh_settings.resolve(cluster.host(server.host))
    result = bench.bench_server(cluster, server, settings, runs, bench.N_PREDICT, False,
                                lambda line: print(line, file=sys.stderr))
    return result["overall"]


def hand_round(info, cluster, server, runs: int, procs: dict) -> dict:
    workers = [(h.name, rpc) for h in cluster.hosts for rpc in h.rpc_servers]
    sh(info, server.host, shell.command("sudo", "-n", "systemctl", "stop", server.unit_name))
    for host, rpc in workers:
        sh(info, host, shell.command("sudo", "-n", "systemctl", "stop", rpc.unit_name))
    try:
        for host, rpc in workers:
            argv, env = procs[(host, rpc.unit_name)]
            start_by_hand(info, host, argv, env, f"/root/bench-rpc-{rpc.port}.log")
            wait_listening(info, host, rpc.bind, rpc.port)
        argv, env = procs[(server.host, server.unit_name)]
        start_by_hand(info, server.host, argv, env, "/root/bench-server.log")
        api_wait(cluster, server)
        return measure(cluster, server, runs)
    finally:
        stop_by_hand(info, server.host, "/root/bench-server.log")
        for host, rpc in workers:
            stop_by_hand(info, host, f"/root/bench-rpc-{rpc.port}.log")
        for host, rpc in workers:
            sh(info, host, shell.command("sudo", "-n", "systemctl", "start", rpc.unit_name))
        sh(info, server.host, shell.command("sudo", "-n", "systemctl", "start", server.unit_name))
        api_wait(cluster, server)


def api_wait(cluster, server) -> None:
    conn = bench.connect(ssh_settings.resolve(cluster.host(server.host)))
    try:
        bench.Api(conn, "127.0.0.1", server.port, None).wait_healthy(300)
    finally:
        conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", default="mdbn")
    parser.add_argument("--runs", type=int, default=3, help="runs per bench (after a warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="deployed/hand alternations")
    parser.add_argument("--keep-lab", action="store_true")
    args = parser.parse_args()

    handle = Lab(name=args.lab, hosts=3)
    info = handle.up()
    try:
        folder = Path(tempfile.mkdtemp(prefix="bench-vs-hand-"))
        text = (REPO / "inventories" / "lab.yaml").read_text()
        text = text.replace("http://127.0.0.1:18080", info.mirrors["hf_api_endpoint"])
        text = text.replace("/var/lib/meshdeploy/lab/mdlab/ssh_config", info.ssh["config"])
        (folder / "lab.yaml").write_text(text)
        subprocess.run([sys.executable, "-m", "meshdeploy", "apply", str(folder / "lab.yaml"),
                        "--auto-approve"], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        cluster = load_cluster(str(folder / "lab.yaml"))
        (server,) = cluster.servers
        if server.api_key_file:
            raise SystemExit("the by-hand copy cannot read the unit's credential: no api_key_file")
        procs = {(h.name, rpc.unit_name): process_of(info, h.name, rpc.unit_name)
                 for h in cluster.hosts for rpc in h.rpc_servers}
        procs[(server.host, server.unit_name)] = process_of(info, server.host, server.unit_name)
        for key, (argv, env) in procs.items():
            print(f"{key[0]} {key[1]}: {' '.join(argv)} {env or ''}", file=sys.stderr)
        got = {"deployed": [], "by hand": []}
        for i in range(args.rounds):
            print(f"round {i + 1}/{args.rounds}: deployed", file=sys.stderr)
            got["deployed"].append(measure(cluster, server, args.runs))
            print(f"round {i + 1}/{args.rounds}: by hand", file=sys.stderr)
            got["by hand"].append(hand_round(info, cluster, server, args.runs, procs))
        rows, medians = [], {}
        for mode, results in got.items():
            for metric in ("pp", "tg"):
                values = [r[metric]["median"] for r in results]
                medians[(mode, metric)] = statistics.median(values)
                rows.append([mode, metric, f"{min(values):.1f}", f"{medians[(mode, metric)]:.1f}",
                             f"{max(values):.1f}"])
        print(tabulate(rows, headers=["cluster", "metric", "min t/s", "median t/s", "max t/s"]))
        for metric in ("pp", "tg"):
            print(f"deployed / by hand, {metric}: "
                  f"{medians[('deployed', metric)] / medians[('by hand', metric)]:.3f}x")
    finally:
        if not args.keep_lab:
            handle.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
