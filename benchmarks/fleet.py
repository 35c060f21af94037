"""A fleet of 30 hosts: from hosts with nothing of meshdeploy's to every server healthy, against a
3-host cluster in the same run; then the no-op plan of the fleet.

    sudo .venv/bin/python benchmarks/fleet.py [--hosts 30] [--servers 3] [--runs 3] [--repeat 1]
            [--keep-lab]

Brings up one lab (name `mdfleet`) of hosts + 3 hosts: node1..nodeN are the fleet, the last
three a cluster of three (orchestrator and two workers, inventories/lab.yaml's shape). Both
clusters' hosts start with the build tools installed (the lab's `toolchain`: its apt goes
through a proxy that caches nothing, so 30 toolchain downloads would time the internet) and
with nothing of meshdeploy's; both compile through the lab's shared ccache, in the same state
for both (the 3-host cluster goes first and compiles the same portable build the fleet does).

The fleet: `--servers` llama-servers, each of its own model (the lab's gemma under another name:
a model is served by one server), each on its own host with an even share of the
other hosts as its rpc-servers. Every host runs Debian 12 on one CPU architecture: one build
key, so one host compiles and every other one copies. Prints, for each cluster: the time from
`apply` to every server healthy (apply ends there), the hosts that compiled (a ninja log under
the build folder) and that copied (the apply's llama_cpp.copy lines, less the compiling
host's, whose copy step packs and serves the build), how busy the machine's CPUs were during
each apply (the lab's hosts share them: near 100%, the time is the machine's, not the hosts'),
and the fleet's time over the 3-host cluster's; then the fleet's no-op plan: median seconds and
remote commands per host (benchmarks/plan_once.py). Each apply, and the no-op plans, start
once the machine's CPUs are quiet (settle()): a lab just booted or a cluster just converged
still works for a while, and that work counted against whichever cluster came next.
"""

if __name__ == "__main__":  # before anything imports ssl; never in a test that imports this
    from gevent import monkey

    monkey.patch_all()

import argparse  # noqa: E402
import re  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from tabulate import tabulate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PREFIX = "/opt/meshdeploy"


def cluster_yaml(info, hosts: list, servers: int, name: str) -> str:
    """inventories/lab.yaml's settings and model for `hosts` (lab hosts), `servers` llama-servers
    on the first hosts of `servers` even groups, the rest of each group its workers."""
    base = (REPO / "inventories" / "lab.yaml").read_text()
    head = base[:base.index("hosts:")].replace("http://127.0.0.1:18080",
                                               info.mirrors["hf_api_endpoint"])
    head = re.sub(r"(?m)^cluster: .*$", f"cluster: {name}", head)
    models = base[base.index("\nmodels:") + 1:base.index("\nservers:")]
    groups = [hosts[i::servers] for i in range(servers)]
    lines = ["hosts:"]
    for group in groups:
        for i, h in enumerate(group):
            lines += [f"  {h.name}:", f"    address: {h.address}",
                      f"    ssh: {{user: deploy, config: {info.ssh['config']}, sudo: true}}",
                      "    backend: cpu"]
            if i:
                lines += ["    rpc_servers:", "      - port: 50052"]
    # One model per server (a model is served once): the lab's gemma under another name each,
    # each downloaded once from the mirror and copied over the LAN to its own hosts.
    gemma = models[models.index("  gemma:"):].rstrip("\n")
    lines.append("models:")
    lines += [gemma.replace("  gemma:", f"  {model(n)}:", 1) for n in range(servers)]
    lines.append("servers:")
    for n, group in enumerate(groups):
        workers = ", ".join(f"{h.name}:50052" for h in group[1:])
        lines += [f"  s{n + 1}:", f"    host: {group[0].name}", f"    model: {model(n)}",
                  "    port: 8080", "    bind: 127.0.0.1", "    ctx_size: 2048",
                  f"    rpc: [{workers}]", "    health: {retries: 90, interval: 2}"]
    return head + "\n".join(lines) + "\n"


def model(n: int) -> str:
    return "gemma" if n == 0 else f"gemma{n + 1}"


def compiled(info, hosts: list) -> list[str]:
    """The hosts whose build folder holds a ninja log with compile lines."""
    found = []
    for h in hosts:
        proc = info.run(h.name, f"cat {PREFIX}/build/*.build.log 2>/dev/null | "
                                "grep -c '^\\[[0-9]*/[0-9]*\\]' || true", root=True)
        if int((proc.stdout.strip() or "0").splitlines()[-1]) > 0:
            found.append(h.name)
    return found


def cpu_times() -> tuple[int, int]:
    """The machine's (busy, all) CPU time in clock ticks, every core together (/proc/stat's
    first line: user nice system idle iowait irq softirq steal; idle and iowait are not busy)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def settle(quiet: float = 0.15, longest: float = 90.0) -> str:
    """Wait until the machine's CPUs are quiet (busy under `quiet` for two seconds running, or
    `longest` seconds have passed): a lab just booted, or a cluster just converged, still has
    work of its own under way (units starting, servers loading), which would count against
    whichever cluster applies next. Says how long it waited and how busy the CPUs were."""
    t0, calm, busy = time.monotonic(), 0, 1.0
    while time.monotonic() - t0 < longest and calm < 2:
        a = cpu_times()
        time.sleep(1)
        b = cpu_times()
        busy = (b[0] - a[0]) / max(1, b[1] - a[1])
        calm = calm + 1 if busy < quiet else 0
    return f"waited {time.monotonic() - t0:.0f} s for quiet CPUs ({busy:.0%} busy)"


def converge(path: Path) -> tuple[float, str, float, float]:
    """apply's seconds, its output, how busy the machine's CPUs were meanwhile (0-1, all
    cores: the lab's hosts and meshdeploy share them, so near 1 means CPU-bound), and the CPU
    seconds of meshdeploy itself (its process and the ssh clients it started)."""
    t0, busy0 = time.monotonic(), cpu_times()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines, stamped = [], []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-u", "-m", "meshdeploy", "apply", str(path),
                                 "--auto-approve"], stdout=subprocess.PIPE, stderr=err,
                                text=True)
        for line in proc.stdout:  # each line with the second it came: the apply's timeline
            lines.append(line)
            stamped.append(f"{time.monotonic() - t0:7.2f} {line}")
        proc.wait()
        err.seek(0)
        stderr = err.read()
    seconds, busy1 = time.monotonic() - t0, cpu_times()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    output = "".join(lines)
    path.with_suffix(".timeline.txt").write_text("".join(stamped))
    if proc.returncode != 0:
        raise SystemExit(f"apply {path.name} failed:\n{output[-4000:]}\n{stderr[-3000:]}")
    own = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return (seconds, output, (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]), own)


def timeline(path: Path) -> str:
    """When the plan was shown, and when each resource's last host ended (seconds from the
    start of apply), from the timeline converge wrote beside the cluster file."""
    ends: dict[str, float] = {}
    planned = None
    for line in path.with_suffix(".timeline.txt").read_text().splitlines():
        at, _, rest = line.strip().partition(" ")
        if planned is None and "will perform the following actions" in rest:
            planned = float(at)
        match = re.match(r"\s*\S+\s+([a-z_]+\.[a-z_]+)\S*\s+ok \(", rest)
        if match:
            ends[match.group(1)] = float(at)
    return f"plan shown at {planned or 0:.1f} s; last host done: " + ", ".join(
        f"{step} {at:.1f}" for step, at in sorted(ends.items(), key=lambda kv: kv[1]))


def slowest(output: str, count: int = 6) -> str:
    """The apply's steps (its closing table: host, step, ok, seconds) whose slowest host took
    longest: where the time to healthy went."""
    worst: dict[str, tuple[float, str]] = {}
    for host, step, seconds in re.findall(r"(?m)^(\S+)\s+(\S+)\s+ok\s+([0-9.]+) s$", output):
        if float(seconds) > worst.get(step, (-1.0, ""))[0]:
            worst[step] = (float(seconds), host)
    top = sorted(worst.items(), key=lambda kv: -kv[1][0])[:count]
    return ", ".join(f"{step} {s:.1f} s ({host})" for step, (s, host) in top)


def copied(output: str, built: list[str]) -> list[str]:
    """The hosts whose llama_cpp.copy step ran, less the builders (theirs packs and serves)."""
    ran = set(re.findall(r"(?m)^\s+(\S+)\s+llama_cpp\.copy\s+ok", output))
    return sorted(ran - set(built))


def converge_both(info, args, workdir: Path) -> float:
    """Both clusters from hosts with nothing, the 3-host one first; prints each; the ratio."""
    fleet, trio = info.hosts[:args.hosts], info.hosts[args.hosts:args.hosts + 3]
    rows = []
    for label, hosts, servers in (("3 hosts", trio, 1),
                                  (f"{args.hosts} hosts", fleet, args.servers)):
        path = workdir / f"{label.split()[0]}.yaml"
        path.write_text(cluster_yaml(info, hosts, servers, f"fleet{len(hosts)}"))
        print(f"{label}: {settle()}", flush=True)
        seconds, output, busy, own = converge(path)
        path.with_suffix(".apply.txt").write_text(output)
        built = compiled(info, hosts)
        copies = copied(output, built)
        rows.append([label, servers, f"{seconds:.1f}", f"{busy:.0%}", len(built),
                     len(copies), ", ".join(built)])
        print(f"{label}: every server healthy after {seconds:.1f} s, the CPUs {busy:.0%} "
              f"busy, meshdeploy's own CPU {own:.1f} s; compiled on "
              f"{', '.join(built) or 'none'}; {len(copies)} copies; slowest steps: "
              f"{slowest(output)}; apply output in {path.with_suffix('.apply.txt')}",
              flush=True)
        print(f"  {label}: {timeline(path)}", flush=True)
    print(tabulate(rows, headers=["cluster", "servers", "apply to healthy s", "CPUs busy",
                                  "compiles", "copies", "compiled on"]))
    ratio = float(rows[1][2]) / float(rows[0][2])
    print(f"ratio {rows[1][0]} vs {rows[0][0]}: {ratio:.2f}x (target: at most 2x)", flush=True)
    return ratio


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hosts", type=int, default=30)
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds from a fresh lab each (the ratio's spread; the no-op plan "
                             "is timed after the last)")
    parser.add_argument("--keep-lab", action="store_true")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat takes 1 or more")

    from plan_speed import plan_once  # benchmarks/, this script's folder

    from meshdeploy.lab import Lab

    ratios = []
    try:
        for round_ in range(args.repeat):
            if round_:
                Lab(name="mdfleet").down()
            t0 = time.monotonic()
            info = Lab(name="mdfleet", hosts=args.hosts + 3, toolchain=True).up()
            print(f"round {round_ + 1}: lab of {args.hosts + 3} hosts up in "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            workdir = Path(tempfile.mkdtemp(prefix="md-fleet-"))
            ratios.append(converge_both(info, args, workdir))
        if args.repeat > 1:
            print(f"ratios over {args.repeat} rounds: "
                  f"{', '.join(f'{r:.2f}x' for r in ratios)}; median "
                  f"{statistics.median(ratios):.2f}x, highest {max(ratios):.2f}x")
        path = workdir / f"{args.hosts}.yaml"
        print(f"no-op plan: {settle()}", flush=True)
        times, commands, changed = [], {}, False
        for _ in range(args.runs):
            seconds, commands, changes = plan_once(path, REPO)
            times.append(seconds)
            changed |= changes
        print(f"no-op plan of {args.hosts} hosts: median {statistics.median(times):.2f} s, "
              f"min {min(times):.2f} s (target: at most 3 s); remote commands per host: "
              f"{max(commands.values())}; changes: {'YES' if changed else 'none'}")
    finally:
        if not args.keep_lab:
            Lab(name="mdfleet").down()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
