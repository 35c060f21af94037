"""services.Rtt's shell, run for real in a throwaway network namespace (`unshare -n`, loopback
only): a listening or a refusing port is a round trip; no route or a dropped connect is no
figure (it was once the time the failure took, reported as a worker's RTT)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from support.require import unmet

from meshdeploy.roles.services.facts import Rtt

# Inside the namespace: loopback up, a listener on 127.0.0.1:2222, every TCP connect to
# 127.0.0.3 dropped (a host that never answers), and no route to 10.99.0.0/16 at all.
SETUP = """
ip link set lo up
nft add table ip t
nft add chain ip t out '{ type filter hook output priority 0; }'
nft add rule ip t out ip daddr 127.0.0.3 tcp dport 22 drop
"$PYTHON" -c 'import socket, time
s = socket.socket(); s.bind(("127.0.0.1", 2222)); s.listen(8); time.sleep(30)' \
    >/dev/null 2>&1 &
L=$!
for _ in $(seq 200); do ss -Hltn 'sport = :2222' | grep -q . && break; sleep 0.05; done
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "a private network namespace with nft needs root"
    for tool in ("nft", "unshare", "ip", "ss", "bash", "timeout"):
        if shutil.which(tool) is None:
            return f"{tool} is missing"
    return None


def test_the_probe_times_answers_and_gives_no_figure_for_no_answer():
    if reason := _unavailable():
        unmet(reason)
    targets = ["127.0.0.1:2222", "127.0.0.2:1", "10.99.0.11:22", "127.0.0.3:22"]
    script = SETUP + Rtt().command(targets) + "\nkill $L\n"
    proc = subprocess.run(["unshare", "-n", "sh", "-ec", script], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    got = Rtt().process(proc.stdout.splitlines())
    assert set(got) == set(targets), proc.stdout
    # Listening and refused: each answered, so each is a (tiny, loopback) round trip.
    assert isinstance(got["127.0.0.1:2222"], int) and isinstance(got["127.0.0.2:1"], int), got
    # No route, and a connect dropped until the 2 s timeout: unreachable, not 2000000 us.
    assert got["10.99.0.11:22"] is None and got["127.0.0.3:22"] is None, proc.stdout
