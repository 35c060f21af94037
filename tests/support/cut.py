"""A lab host's link cut silently (an nftables table inside its namespace dropping one port's
traffic both ways: no RST, nothing answers), and md-failover's state file read while it
switches: what the failover tests on the rootless and WireGuard labs share."""

from __future__ import annotations

import json
import subprocess
import time
from contextlib import contextmanager

from meshdeploy.lab import net

TABLE = "mdtest_cut"


def _nft(info, host: str, *args: str, rules: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", net.host_netns(info.name, host), "nft", *args],
                          input=rules, text=True, capture_output=True, timeout=30)


@contextmanager
def silent_cut(info, host: str, port: int, proto: str = "tcp"):
    """While the block runs, `host` neither receives on nor sends from `port` (its listener:
    the peers' packets to it vanish, and so do its replies)."""
    done = _nft(info, host, "-f", "-", rules=(
        f"table inet {TABLE} {{\n"
        f" chain in {{ type filter hook input priority -10; {proto} dport {port} drop; }}\n"
        f" chain out {{ type filter hook output priority -10; {proto} sport {port} drop; }}\n"
        "}\n"))
    assert done.returncode == 0, done.stderr
    try:
        yield
    finally:
        _nft(info, host, "delete", "table", "inet", TABLE)


def state(info, host: str, path: str, root: bool = False) -> dict:
    """md-failover's state on `host` ({} while there is none)."""
    done = info.run(host, f"cat {path}", root=root)
    return json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else {}


def wait_state(info, host: str, path: str, predicate, timeout: float,
               root: bool = False) -> dict:
    """The first state that satisfies `predicate` within `timeout` s, else the last one read."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = state(info, host, path, root)
        if got and predicate(got):
            return got
        time.sleep(0.5)
    return state(info, host, path, root)


def serving(lost: list[str]):
    """A predicate: md-failover serves with exactly `lost` away."""
    return lambda s: s.get("state") == "serving" and s.get("lost") == lost


def assert_degraded(path, lost: str) -> None:
    """`meshdeploy status` of the cluster file `path` says degraded, and md-failover's row
    names the placement without `lost`."""
    from support.cli import meshdeploy

    from meshdeploy.errors import DEGRADED

    status = meshdeploy("status", path, "--json")
    assert status.returncode == DEGRADED, status.stdout + status.stderr
    row = next(r for r in json.loads(status.stdout) if r["service"] == "failover main")
    assert row["answer"].startswith(f"without {lost} since "), row
