"""What each section of a host's probe costs on the host: the one probe command a plan runs,
cut into its sections, each run RUNS times in one shell there (over the lab's ssh), timed by the
host's own clock (CPU time of that shell and its children: `times`). Prints one row per section,
costliest first, and the whole probe's.

    python benchmarks/probe_cost.py CLUSTER_FILE HOST [RUNS]

On a fleet of hosts that share a machine's cores, a plan's probe time is about the sum of every
host's probe CPU divided by the cores: this says where that CPU goes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def main(path: str, host_name: str, runs: int = 20) -> int:
    from meshdeploy.core.loading import load_cluster
    from meshdeploy.core import probe
    from meshdeploy.engine.planner import probe_sections
    from meshdeploy.remote import ssh_settings

    cluster = load_cluster(Path(path))
    host = cluster.host(host_name)
    first = cluster.hosts[0].name == host_name
    sections = probe_sections(cluster, host, first)
    parts = [(s.key, s.script("x", i, host.sudo)) for i, s in enumerate(sections)]
    parts.append(("whole probe", probe.compose(sections, "x", sudo=host.sudo)))
    body = []
    for n, (_, script) in enumerate(parts):
        body.append(f"fn{n}() {{\n{script}\n}}")
        body.append(f"s=$(date +%s%N); i=0; while [ $i -lt {runs} ]; do fn{n} >/dev/null 2>&1; "
                    f"i=$((i+1)); done; echo @@part {n} $(( $(date +%s%N) - s )); times")
    target = ssh_settings.resolve(host).target  # the name its ssh_config knows it by
    ssh = ["ssh", "-o", "BatchMode=yes", *(["-F", host.ssh.config] if host.ssh.config else []),
           *(["-l", host.ssh.user] if host.ssh.user else []), target]
    done = subprocess.run([*ssh, "sh -s"], input="\n".join(body) + "\n", capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 1
    # `times` prints the shell's user/system, then its children's: "0m0.010s 0m0.020s".
    cpu, wall, last = {}, {}, 0.0
    for block in done.stdout.split("@@part ")[1:]:
        head, *lines = block.strip().splitlines()
        n, ns = (int(x) for x in head.split())
        found = re.findall(r"(\d+)m([\d.]+)s", " ".join(lines))
        total = sum(float(m) * 60 + float(s) for m, s in found)
        cpu[n], wall[n], last = total - last, ns / 1e9, total  # `times` is cumulative
    rows = [(key, cpu.get(n, 0.0) / runs * 1000, wall.get(n, 0.0) / runs * 1000)
            for n, (key, _) in enumerate(parts)]
    whole = rows.pop()
    print(f"{host_name}: per probe section, ms (mean of {runs} runs; CPU of the shell and its "
          "children, then wall)")
    for key, ms, wall_ms in sorted(rows, key=lambda r: -r[2]):
        print(f"  {key:<28} {ms:7.1f} {wall_ms:7.1f}")
    print(f"  {'sum of sections':<28} {sum(r[1] for r in rows):7.1f} "
          f"{sum(r[2] for r in rows):7.1f}")
    print(f"  {whole[0]:<28} {whole[1]:7.1f} {whole[2]:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:4])))
