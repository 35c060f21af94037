"""Model distribution: one internet download and tensor fetches over the LAN, vs today's way.

Usage (root, on a machine that can run the lab, with nft and tc; ~35 min, ~16 GB of disk):
    .venv/bin/python benchmarks/distribution.py [--lab mddist] [--internet 100mbit]
            [--lan 1gbit] [--keep-lab]

Brings lab `--lab` up (4 hosts: node1 orchestrator, node2..node4 each one cached rpc-server),
writes a ~2.1 GB synthetic llama GGUF (tests/support/synthetic.py LARGE) and serves it from a
second Hugging Face mirror, `hf-slow`, that sends file bodies at --internet for all hosts
together (hfmirror --rate: the one home uplink). Every bridge -> host link is shaped to --lan
(tc tbf). One untimed apply builds llama.cpp everywhere (through the lab's unlimited mirror);
then for today's way (rpc_servers[].fetch: false; at commit aa9b7df every such host
downloaded the whole GGUF from the mirror and seeded from it, since then it copies node1's over
the LAN: docs/benchmarks.md says which commit measured what) and the new one (fetch: true: node1 downloads it once, the workers
fetch the byte ranges of their tensors from node1's copy), it stops the services, deletes the
model and the rpc caches on every host and times `meshdeploy apply` (which returns once
llama-server answers /health 200). Counted per host: internet bytes (nft counters in the lab
namespace on the mirror's port), LAN bytes (what the bridge sent the host, less everything
from the lab's own services), disk (the model folder and the rpc cache). Prints Markdown tables
and the issue's three targets; exits 1 when the two ways' greedy outputs differ. The nft table
and the shaping are always removed; the lab is taken down unless --keep-lab.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshdeploy.core.paths import model_dir, rpc_cache_dir, rpc_unit_name
from meshdeploy.core.share import LOG as rpc_cache_share_log
from meshdeploy.lab import Lab, LabInfo, base, hfstore, net, procs, services
from meshdeploy.placement.layers import device_tensors, place, wire_bytes
from meshdeploy.placement.tensors import weight_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import wire  # noqa: E402
from support.labfile import for_lab  # noqa: E402
from support.synthetic import LARGE, write_llama  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ORCHESTRATOR = "node1"
WORKERS = ("node2", "node3", "node4")
HOSTS = (ORCHESTRATOR, *WORKERS)
PREFIX = "/opt/meshdeploy"  # llama_cpp.prefix of inventories/lab.yaml
MODEL = "synthetic"
HF_REPO, HF_FILE = "meshdeploy/synthetic-llama-2g", "synthetic-2g.gguf"
RPC_PORT = 50052
SERVER_UNIT = "meshdeploy-server-main"
MODEL_DIR = model_dir(PREFIX, MODEL)
CACHE_DIR = rpc_cache_dir(RPC_PORT)  # /var/cache/meshdeploy-rpc-50052/rpc (a DynamicUser's
PRIVATE_CACHE_DIR = f"/var/cache/private/{rpc_unit_name(RPC_PORT)}/rpc"  # real folder is here)
SLOW = "hf-slow"
# On the bridge of this lab's own namespace; the lab's services keep 3142, 9418 and 8080.
SLOW_PORT = 8081
NFT_TABLE = "md_distribution"
ETHERNET_HEADER = 14  # the veth counts frames, nft (ip family, output hook) counts IP packets
MODES = (("today", False), ("new", True))  # (name, rpc_servers[].fetch)
TARGETS = {"internet": 1.05, "disk": 1.05, "wall": 0.4}
_UNITS = {"k": 1e3, "m": 1e6, "g": 1e9}


def bits_per_second(text: str) -> float:
    """"100mbit", "1gbit", "500kbit" (as tc writes rates) -> bits per second."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmg]?)bit\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want a rate such as 100mbit or 1gbit")
    return float(m.group(1)) * _UNITS.get(m.group(2), 1)


def tc_rate(text: str) -> str:
    bits_per_second(text)
    return text.strip().lower()


def meshdeploy(log: Path, *args) -> str:
    """Run the CLI as the operator does; its output goes to `log` (and the tail to the screen
    when it fails)."""
    argv = [sys.executable, "-m", "meshdeploy", *map(str, args)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=3600)
    except subprocess.TimeoutExpired:
        sys.exit(f"meshdeploy {' '.join(map(str, args))} ran past an hour")
    log.write_text(f"$ {' '.join(argv)}\n-> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    if proc.returncode != 0:
        sys.exit(f"meshdeploy {' '.join(map(str, args))} failed (full output in {log}):\n"
                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def sh(info: LabInfo, host: str, script: str, timeout: float = 600) -> str:
    proc = info.run(host, script, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"{host}: `{script}` failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return proc.stdout


# ---- the cluster file ----------------------------------------------------------------------

def cluster_yaml(info: LabInfo, served: dict, endpoint: str, api_endpoint: str,
                 fetch: bool, ctx: int = 512) -> str:
    """inventories/lab.yaml's settings for lab `info`, its hosts node1..node4 (node2..node4 one
    cached rpc-server each, `fetch` as given) and the synthetic model, split [1, 1, 1]."""
    text = for_lab((REPO / "inventories" / "lab.yaml").read_text(), info)
    head = text[:text.index("\nhosts:\n") + 1]
    hf = (f"huggingface:\n  endpoint: {endpoint}\n"
          f"  api_endpoint: {api_endpoint}   # the same mirror, as the control machine "
          "reaches it\n")
    head, found = re.subn(r"^huggingface:\n(?:  .*\n)+", lambda _: hf, head, flags=re.M)
    if found != 1:
        sys.exit("inventories/lab.yaml has no huggingface: section to point at the mirror")
    ssh = f"{{user: {info.ssh['user']}, config: {info.ssh['config']}, sudo: true}}"
    lines = ["hosts:"]
    for h in HOSTS:
        lines += [f"  {h}:",
                  f"    address: {info.host(h).address}",
                  f"    ssh: {ssh}",
                  "    backend: cpu"]
        if h in WORKERS:
            lines += ["    rpc_servers:",
                      f"      - {{port: {RPC_PORT}, cache: true, fetch: {str(fetch).lower()}}}"]
    return head + "\n".join(lines) + f"""
models:
  {MODEL}:
    huggingface:
      repo: {served['repo']}
      file: {served['file']}
      sha256: {served['sha256']}
servers:
  main:
    host: {ORCHESTRATOR}
    model: {MODEL}
    port: 8080
    bind: 127.0.0.1
    ctx_size: {ctx}
    tensor_split: [1, 1, 1]
    health: {{retries: 1800, interval: 0.5}}
"""


# ---- the slow mirror and the byte counters -------------------------------------------------

def start_slow_mirror(lab: Lab, root: Path, rate_bytes: float) -> dict:
    """A second mirror of `root` on the bridge at SLOW_PORT, bodies capped at `rate_bytes`/s."""
    running = procs.running(lab.run_dir, SLOW, lab.marker)
    if running:  # a kept lab's mirror may run at another rate: start it again with this one
        procs.kill_all([running])
    return services.serve_hf(lab.name, lab.run_dir, lab.marker, SLOW, root, SLOW_PORT,
                             args=("--rate", repr(float(rate_bytes))))


def nft(lab: str, *args: str, stdin: str | None = None) -> str:
    proc = subprocess.run(["ip", "netns", "exec", lab, "nft", *args], input=stdin,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nft {' '.join(args)} in {lab}: {proc.stderr.strip()}")
    return proc.stdout


def counters_up(lab: str, info: LabInfo) -> None:
    """Per host, in the lab namespace's output hook (where the mirrors' relays send from):
    hf_<host> counts what the slow mirror's port sent it, lab_<host> all the bridge address
    (mirrors, apt proxy, git) sent it."""
    counters_down(lab)
    rules = []
    for h in HOSTS:
        to = f"ip saddr {net.BRIDGE_ADDRESS} ip daddr {info.host(h).address}"
        rules += [f'    {to} tcp sport {SLOW_PORT} counter name "hf_{h}"',
                  f'    {to} counter name "lab_{h}"']
    objects = [f"  counter {kind}_{h} {{ }}" for h in HOSTS for kind in ("hf", "lab")]
    nft(lab, "-f", "-", stdin="\n".join(
        [f"table ip {NFT_TABLE} {{", *objects, "  chain out {",
         "    type filter hook output priority 0; policy accept;", *rules, "  }", "}", ""]))


def counters_down(lab: str) -> None:
    subprocess.run(["ip", "netns", "exec", lab, "nft", "delete", "table", "ip", NFT_TABLE],
                   capture_output=True)


def read_counters(lab: str) -> dict[str, tuple[int, int]]:
    """counter name -> (packets, bytes)."""
    doc = json.loads(nft(lab, "-j", "list", "counters", "table", "ip", NFT_TABLE))
    return {c["counter"]["name"]: (c["counter"]["packets"], c["counter"]["bytes"])
            for c in doc["nftables"] if "counter" in c}


# ---- the hosts -----------------------------------------------------------------------------

def wipe(info: LabInfo) -> None:
    """Every host with nothing of the model: llama-server, then the rpc-servers stopped (no
    tensor left in a process's memory), the model folder and the rpc cache entries removed.
    The llama.cpp build, the tools and the unit files stay."""
    sh(info, ORCHESTRATOR, f"sudo systemctl stop {SERVER_UNIT}; sudo rm -rf {MODEL_DIR}")
    for h in WORKERS:
        sh(info, h, f"sudo systemctl stop {rpc_unit_name(RPC_PORT)}; "
                    f"sudo rm -rf {MODEL_DIR} {CACHE_DIR} {PRIVATE_CACHE_DIR}")
    left = {h: disk(info, h) for h in HOSTS}
    if any(left.values()):
        sys.exit(f"bytes of the model left after the wipe: {left}")


def disk(info: LabInfo, host: str) -> int:
    """Bytes of the model folder and the rpc cache on `host` (du -sb; a missing one is 0)."""
    out = sh(info, host, f"sudo du -sb {MODEL_DIR} {CACHE_DIR} 2>/dev/null; true")
    return sum(int(line.split()[0]) for line in out.splitlines() if line.strip())


def ggufs(info: LabInfo, host: str) -> list[str]:
    return sh(info, host, f"sudo find {MODEL_DIR} -name '*.gguf*' 2>/dev/null; true").split()


def share_log_lines(info: LabInfo) -> int:
    return int(sh(info, ORCHESTRATOR, f"sudo cat {rpc_cache_share_log} 2>/dev/null | wc -l")
               .strip() or 0)


def share_served(info: LabInfo, skip: int) -> dict[str, int]:
    """Body bytes md-share on node1 sent, by client address, in its log after line `skip`."""
    out = sh(info, ORCHESTRATOR, f"sudo tail -n +{skip + 1} {rpc_cache_share_log} 2>/dev/null; "
                                 "true")
    served: dict[str, int] = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) == 7 and words[2] == "GET" and words[6].isdigit():
            served[words[1]] = served.get(words[1], 0) + int(words[6])
    return served


def mirror_gets(log: Path, mark: int, served: dict) -> int:
    """Body GETs (200 or 206) of the model file in the slow mirror's log after byte `mark`."""
    text = log.read_bytes()[mark:].decode(errors="replace") if log.exists() else ""
    return sum(1 for line in text.splitlines()
               if f"GET /{served['repo']}/resolve/" in line and f"/{served['file']} " in line
               and ('" 200 ' in line or '" 206 ' in line))


# ---- one timed apply -----------------------------------------------------------------------

def run_mode(info: LabInfo, name: str, cluster: Path, work: Path, served: dict,
             slow_log: Path) -> dict:
    wipe(info)
    share_mark = share_log_lines(info)
    log_mark = slow_log.stat().st_size if slow_log.exists() else 0
    tx0 = {h: wire.tx_bytes(info.name, h) for h in HOSTS}
    c0 = read_counters(info.name)
    started = time.monotonic()
    meshdeploy(work / f"{name}.apply.log", "apply", cluster, "--auto-approve")
    wall = time.monotonic() - started
    tx1 = {h: wire.tx_bytes(info.name, h) for h in HOSTS}
    c1 = read_counters(info.name)

    def delta(counter: str) -> tuple[int, int]:
        return c1[counter][0] - c0[counter][0], c1[counter][1] - c0[counter][1]

    row = {"wall": wall, "internet": {}, "lan": {}, "lab_other": {}, "disk": {}, "ggufs": {}}
    for h in HOSTS:
        row["internet"][h] = delta(f"hf_{h}")[1]
        packets, ip_bytes = delta(f"lab_{h}")
        from_lab = ip_bytes + ETHERNET_HEADER * packets  # as the veth counts them
        row["lan"][h] = max(tx1[h] - tx0[h] - from_lab, 0)
        row["lab_other"][h] = ip_bytes - row["internet"][h]
        row["disk"][h] = disk(info, h)
        row["ggufs"][h] = ggufs(info, h)
    row["share_served"] = share_served(info, share_mark)
    row["mirror_gets"] = mirror_gets(slow_log, log_mark, served)
    row["text"] = wire.complete(info)
    print(f"{name}: {wall:.1f} s to /health 200; internet "
          f"{sum(row['internet'].values()) / 1e6:,.1f} MB ({row['mirror_gets']} body GETs at "
          f"the mirror); LAN {sum(row['lan'].values()) / 1e6:,.1f} MB; disk {row['disk']}",
          flush=True)
    return row


# ---- the report ----------------------------------------------------------------------------

def mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def report(rows: dict, size: int, share: dict, cached: dict, info: LabInfo) -> bool:
    print("\n| mode | wall time to /health 200 (s) | internet (MB) | internet / model | "
          "LAN (MB) | " + " | ".join(f"disk {h} (MB)" for h in HOSTS) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(HOSTS))
    for mode, r in rows.items():
        internet = sum(r["internet"].values())
        disks = [mb(r["disk"][ORCHESTRATOR])] + [
            f"{mb(r['disk'][h])} (share {mb(share[h])})" for h in WORKERS]
        print(f"| {mode} | {r['wall']:.1f} | {mb(internet)} | {internet / size:.2f} x | "
              f"{mb(sum(r['lan'].values()))} | " + " | ".join(disks) + " |")

    print("\n| mode | host | internet (MB) | LAN (MB) | disk (MB) | share (MB) | disk / share "
          "| GGUF on the host |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for mode, r in rows.items():
        for h in HOSTS:
            ratio = f"{r['disk'][h] / share[h]:.3f}" if h in share else "-"
            print(f"| {mode} | {h} | {mb(r['internet'][h])} | {mb(r['lan'][h])} | "
                  f"{mb(r['disk'][h])} | {mb(share[h]) if h in share else '-'} | {ratio} | "
                  f"{'yes' if r['ggufs'][h] else 'no'} |")

    print(f"\nModel: {mb(size)} MB. Share = bytes of the tensors the placement puts on the "
          "worker; of it, cacheable (> 10 MiB, kept in the rpc cache): "
          + ", ".join(f"{h} {mb(cached[h])} MB" for h in WORKERS) + ".")
    new = rows["new"]
    print("md-share on node1 served (new): " + ", ".join(
        f"{h} {mb(new['share_served'].get(info.host(h).address, 0))} MB" for h in WORKERS))
    other = {m: sum(r["lab_other"].values()) for m, r in rows.items()}
    if any(v > 1e6 for v in other.values()):
        print("Note: the lab's other services (apt, git, the unlimited mirror) sent the hosts "
              + ", ".join(f"{mb(v)} MB ({m})" for m, v in other.items())
              + " during the timed applies; counted in neither internet nor LAN.")

    today, internet_new = rows["today"], sum(new["internet"].values())
    worst = max(new["disk"][h] / share[h] for h in WORKERS)
    wall = new["wall"] / today["wall"]
    checks = [
        ("internet bytes (new) / model", internet_new / size, TARGETS["internet"],
         f"today {sum(today['internet'].values()) / size:.2f} x, N+1 = {len(HOSTS)}"),
        ("disk per worker (new) / its share, worst", worst, TARGETS["disk"],
         f"today {max(today['disk'][h] / share[h] for h in WORKERS):.2f} x"),
        ("wall time new / today", wall, TARGETS["wall"],
         f"{new['wall']:.1f} s vs {today['wall']:.1f} s"),
    ]
    print("\n| target | measured | at most | met |\n|---|---:|---:|---|")
    for what, value, limit, note in checks:
        print(f"| {what} ({note}) | {value:.3f} | {limit} | {'yes' if value <= limit else 'NO'} |")
    same = today["text"] == new["text"]
    print(f"\nGreedy output (temperature 0, seed 42, 24 tokens) identical in both ways: {same}")
    for mode, r in rows.items():
        print(f"  {mode}: {r['text']!r}")
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lab", default="mddist", help="lab name (default mddist)")
    ap.add_argument("--internet", default="100mbit", type=tc_rate,
                    help="the slow mirror's total rate for file bodies (default 100mbit)")
    ap.add_argument("--lan", default="1gbit", type=tc_rate,
                    help="tc tbf rate of every bridge -> host link (default 1gbit)")
    ap.add_argument("--keep-lab", action="store_true", help="leave the lab (and cluster) up")
    args = ap.parse_args()
    rate_bytes = bits_per_second(args.internet) / 8

    lab = Lab(name=args.lab, hosts=len(HOSTS))
    work = Path(tempfile.mkdtemp(prefix="meshdeploy-distribution-"))
    info, same = None, False
    try:
        lab.up()
        info = LabInfo.load(lab.state_dir)
        t0 = time.monotonic()
        model = write_llama(work / HF_FILE, LARGE)
        root = base.cache_root() / "hf"  # the lab mirror's root too: the untimed apply uses it
        served = hfstore.add_file(root, HF_REPO, HF_FILE, model)
        size = served["size"]
        tensors = weight_tensors(model)
        placement = place(LARGE.n_layers, list(WORKERS), [1, 1, 1])
        mine = {h: device_tensors(placement, tensors, i) for i, h in enumerate(WORKERS)}
        share = {h: sum(t.size for t in ts) for h, ts in mine.items()}
        cached = {h: wire_bytes(ts)[0] for h, ts in mine.items()}
        model.unlink()  # the mirror keeps its hard link
        print(f"model: {size / 1e9:.2f} GB, written and hashed in {time.monotonic() - t0:.1f} s; "
              f"placement {placement.describe()}", flush=True)

        slow = start_slow_mirror(lab, root, rate_bytes)
        print(f"slow mirror: {slow['hf_endpoint']} (control machine: {slow['hf_api_endpoint']}), "
              f"{rate_bytes / 1e6:.2f} MB/s of bodies for all hosts together", flush=True)
        cluster = work / "cluster" / "distribution.yaml"
        cluster.parent.mkdir()

        # Untimed: llama.cpp built and installed on every host, md-rpc-seed and md-share in
        # place, through the lab's unlimited mirror.
        cluster.write_text(cluster_yaml(info, served, info.mirrors["hf_endpoint"],
                                        info.mirrors["hf_api_endpoint"], fetch=True))
        t0 = time.monotonic()
        meshdeploy(work / "warm-up.apply.log", "apply", cluster, "--auto-approve")
        print(f"warm-up apply (builds): {time.monotonic() - t0:.1f} s", flush=True)

        slow_log = lab.run_dir / f"{SLOW}.log"
        rows = {}
        counters_up(info.name, info)
        with wire.shaped(info.name, HOSTS, args.lan):
            for mode, fetch in MODES:
                cluster.write_text(cluster_yaml(info, served, slow["hf_endpoint"],
                                                slow["hf_api_endpoint"], fetch))
                (work / f"{mode}.yaml").write_text(cluster.read_text())
                rows[mode] = run_mode(info, mode, cluster, work, served, slow_log)
        print(f"\ninternet {args.internet} (mirror --rate {rate_bytes:.0f} B/s, all hosts "
              f"together), LAN {args.lan} (tc tbf on every bridge -> host veth); apply "
              f"outputs in {work}")
        same = report(rows, size, share, cached, info)
    finally:
        if info is not None:
            counters_down(info.name)
        if not args.keep_lab and lab.touched:  # touched: up() got past its checks
            lab.down()
        (work / HF_FILE).unlink(missing_ok=True)
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
