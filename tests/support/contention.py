"""Workers of different speed on one machine: the lab's hosts share its CPUs, and cgroup CPU
limits are not enforced inside them, so a worker is made slower by sharing its core with a
busy loop. The fast worker's rpc-server is pinned alone to CPU 0, the slow one's to CPU 1 beside
the loop (a transient unit of its own on the slow host). rpc-servers on one thread each keep
the two from crowding each other."""

from __future__ import annotations

UNIT = "meshdeploy-rpc-50052"
LOOP = "md-test-busy-loop"


def _pid(info, host: str) -> str:
    pid = info.run(host, f"systemctl show -p MainPID --value {UNIT}").stdout.strip()
    assert pid.isdigit() and pid != "0", (host, pid)
    return pid


def slow_down(info, fast: str, slow: str, loops: int = 1) -> None:
    """`slow`'s rpc-server shares CPU 1 with `loops` busy loops; `fast`'s has CPU 0 to itself
    (its threads moved with `taskset -a`; a restart of the unit undoes it). More loops leave the
    slow worker a smaller share of its core, so that other work on the machine, which the
    scheduler puts on either core, cannot make the two workers look alike."""
    for host, cpu in ((fast, 0), (slow, 1)):
        done = info.run(host, f"taskset -apc {cpu} {_pid(info, host)}", root=True)
        assert done.returncode == 0, done.stderr
    for unit in _loops(loops):
        loop = info.run(slow, f"systemd-run --unit {unit} -p CPUAffinity=1 "
                              "sh -c 'while :; do :; done'", root=True)
        assert loop.returncode == 0, loop.stderr


def _loops(n: int) -> list[str]:
    return [LOOP] + [f"{LOOP}-{i}" for i in range(2, n + 1)]


def release(info, slow: str) -> None:
    """Every loop slow_down may have started (stopping one that is not there is harmless)."""
    info.run(slow, f"systemctl stop {' '.join(_loops(MAX_LOOPS))}", root=True)


MAX_LOOPS = 4
