"""Failover on the converged lab (conftest's converged_lab: node1 orchestrates gemma, node2 and
node3 serve rpc-server; servers.main.failover.tolerate is 1 by default): md-failover runs
llama-server on the full placement, notices a worker whose link drops silently (an nftables
drop inside node3's namespace, both ways, no RST) or whose rpc-server stops, switches to the
plan's placement without it while completions keep being asked, and goes back to the full
placement once the worker answers again."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest
from support.cli import meshdeploy

from meshdeploy.errors import DEGRADED, DOWN, OK
from meshdeploy.lab import net

pytestmark = [pytest.mark.lab, pytest.mark.build]

TABLE = "mdtest_failover"
STATE = "/run/meshdeploy-server-main/failover.json"


@pytest.fixture(scope="module")
def lab(converged_lab, tmp_path_factory):
    """The converged cluster file, copied with its lock file into a folder of its own: device
    speeds a sweep kept beside the original (test_bench_lab's) would move the split. Applied,
    so llama-server runs its split by memory (node2 layers 0-9, node3 10-17 and the output)."""
    info, _, original = converged_lab
    folder = tmp_path_factory.mktemp("failover")
    path = folder / original.name
    path.write_text(original.read_text())
    lock = original.with_name(original.stem + ".lock.json")
    if lock.exists():
        (folder / lock.name).write_text(lock.read_text())
    applied = meshdeploy("apply", path, "--auto-approve")
    assert applied.returncode == 0, applied.stdout[-3000:] + applied.stderr
    return info, path


def state(info) -> dict:
    done = info.run("node1", f"sudo -n cat {STATE}")
    return json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else {}


def wait_state(info, predicate, timeout: float) -> tuple[dict, float]:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        s = state(info)
        if s and predicate(s):
            return s, time.monotonic() - started
        time.sleep(0.5)
    return state(info), time.monotonic() - started




def complete(info) -> bool:
    return ask(info) == 0


def ask(info) -> int:
    """One short completion on node1's llama-server, asked inside node1's namespace: curl's
    exit status (0 answered; 7 refused and 22 an HTTP error such as 503 while loading; 52 and
    56 cut off mid-request)."""
    body = json.dumps({"prompt": "The capital of France is", "n_predict": 4,
                       "temperature": 0})
    done = subprocess.run(["ip", "netns", "exec", net.host_netns(info.name, "node1"), "curl",
                           "-sf", "-m", "30", "-H", "Content-Type: application/json",
                           "-d", body, "http://127.0.0.1:8080/completion"],
                          capture_output=True, text=True, timeout=40)
    if done.returncode == 0 and '"content"' not in done.stdout:
        return 1
    return done.returncode


class Loop:
    """Completions one after another, each recorded as (asked, answered, ok)."""

    def __init__(self, info):
        self.info, self.results, self.codes, self.running = info, [], [], True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            t = time.monotonic()
            rc = ask(self.info)
            self.results.append((t, time.monotonic(), rc == 0))
            self.codes.append(rc)
            time.sleep(0.3)

    def stop(self):
        self.running = False
        self.thread.join(60)


def wait_for_health(info, timeout: float) -> float:
    """The time (monotonic) node1's llama-server first answers /health 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = subprocess.run(["ip", "netns", "exec", net.host_netns(info.name, "node1"),
                               "curl", "-sf", "-m", "5", "http://127.0.0.1:8080/health"],
                              capture_output=True, text=True, timeout=10)
        if done.returncode == 0:
            return time.monotonic()
        time.sleep(0.2)
    raise AssertionError("llama-server did not answer /health")


def _nft(info, host: str, rules: str) -> None:
    subprocess.run(["ip", "netns", "exec", net.host_netns(info.name, host), "nft", "-f", "-"],
                   input=rules, text=True, check=True, capture_output=True, timeout=30)


def test_the_plan_shows_the_placements_and_md_failover_runs_the_full_one(lab):
    info, path = lab
    done = meshdeploy("plan", path)
    assert done.returncode == 0, done.stderr
    assert "Failover (up to 1 worker host away; md-failover switches by itself):" in done.stdout
    assert "without node3: node2:50052/CPU: layers 0-17 + output" in done.stdout
    assert "No changes" in done.stdout
    unit = info.run("node1", "systemctl cat meshdeploy-server-main").stdout
    assert "md-failover-" in unit and "SystemCallFilter=pidfd_getfd" in unit
    s, _ = wait_state(info, lambda s: s.get("state") == "serving", 60)
    assert s["state"] == "serving" and s["lost"] == [], s
    assert complete(info)
    done = meshdeploy("status", path, "--json", "--window", "0")
    assert done.returncode == OK, done.stdout + done.stderr
    rows = {(r["host"], r["service"]): r for r in json.loads(done.stdout)}
    assert rows[("node1", "failover main")]["answer"].startswith("full placement since "), rows


def test_a_silent_link_loss_switches_and_the_return_restores_the_full_placement(lab):
    info, _ = lab
    node1 = info.host("node1").address
    assert wait_state(info, lambda s: s.get("state") == "serving" and not s["lost"], 60)[0]
    loop = Loop(info)
    try:
        time.sleep(3)
        cut = time.monotonic()
        _nft(info, "node3", f"table inet {TABLE} {{\n"
                            "  chain input { type filter hook input priority -10; policy accept;\n"
                            f"    ip saddr {node1} drop\n  }}\n"
                            "  chain output { type filter hook output priority -10; "
                            "policy accept;\n"
                            f"    ip daddr {node1} drop\n  }}\n}}\n")
        try:
            s, waited = wait_state(info, lambda s: s["lost"] == ["node3"]
                                   and s["state"] == "serving", 90)
            assert s["lost"] == ["node3"] and s["rpc"] == f"{info.host('node2').address}:50052", s
            switched = time.monotonic()
            deadline = switched + 60
            while time.monotonic() < deadline and not any(
                    ok for t, _, ok in loop.results if t > switched):
                time.sleep(0.5)
            served = [t for t, _, ok in loop.results if ok and t > cut]
            assert served, "no completion answered on the placement without node3"
            print(f"silent loss -> switched in {switched - cut:.1f} s (state seen after "
                  f"{waited:.1f} s); first completion {served[0] - cut:.1f} s after the cut")
            # status: the server answers, on the placement without node3: degraded.
            done = meshdeploy("status", lab[1], "--json", "--window", "0")
            assert done.returncode == DEGRADED, done.stdout + done.stderr
            rows = {(r["host"], r["service"]): r for r in json.loads(done.stdout)}
            assert rows[("node1", "llama-server main")]["healthy"], rows
            row = rows[("node1", "failover main")]
            assert row["answer"].startswith("without node3 since "), row
        finally:
            _nft(info, "node3", f"delete table inet {TABLE}\n")
        back = time.monotonic()
        s, _ = wait_state(info, lambda s: s["lost"] == [] and s["state"] == "serving", 90)
        assert s["lost"] == [] and s["state"] == "serving", s
        returned = time.monotonic()
        ready = wait_for_health(info, 60)
        time.sleep(5)
        print(f"link back -> full placement in {returned - back:.1f} s, answering "
              f"{ready - back:.1f} s after the link came back")
    finally:
        loop.stop()
    # md-failover waited for the requests in flight before it restarted llama-server, and its
    # front kept those asked during the restart waiting for the new one: the return failed
    # no request, cut off or refused.
    since_back = [rc for (a, _, _), rc in zip(loop.results, loop.codes) if a > back]
    lost = [rc for (a, _, _), rc in zip(loop.results, loop.codes) if cut < a <= back]
    print(f"{len(since_back)} completions asked after the link came back, "
          f"{sum(rc != 0 for rc in since_back)} failed; while it was away "
          f"{sum(rc != 0 for rc in lost)} of {len(lost)} failed")
    assert since_back and all(rc == 0 for rc in since_back), since_back
    after = [ok for a, _, ok in loop.results if a > ready]
    assert after and all(after), loop.results[-10:]


def test_a_stopped_worker_switches_at_once_and_its_return_is_seen(lab):
    info, _ = lab
    assert wait_state(info, lambda s: s.get("state") == "serving" and not s["lost"], 60)[0]
    stopped = time.monotonic()
    info.run("node2", "sudo -n systemctl stop meshdeploy-rpc-50052")
    try:
        s, _ = wait_state(info, lambda s: s["lost"] == ["node2"] and s["state"] == "serving", 60)
        assert s["lost"] == ["node2"], s
        switched = time.monotonic() - stopped
        wait_for_health(info, 60)
        assert complete(info)
        print(f"rpc-server stopped -> serving without node2 in {switched:.1f} s")
    finally:
        info.run("node2", "sudo -n systemctl start meshdeploy-rpc-50052")
    s, _ = wait_state(info, lambda s: s["lost"] == [] and s["state"] == "serving", 90)
    assert s["lost"] == [], s
    wait_for_health(info, 60)
    assert complete(info)
    done = meshdeploy("plan", lab[1])
    assert "No changes" in done.stdout, done.stdout


def test_with_no_placement_for_the_workers_left_the_server_is_down_not_restarting(lab):
    """Both workers away: tolerate 1 has no placement for that set (as a model that does not
    fit without one worker has none for it). md-failover says "down while node2, node3 are
    away" in its state, its log and to a request (503 from its front at once), starts no
    llama-server (no restart loop), and `meshdeploy status` exits DOWN with that row. The
    first worker back brings the placement with it, both back the full one."""
    info, _ = lab
    assert wait_state(info, lambda s: s.get("state") == "serving" and not s["lost"], 60)[0]
    for host in ("node2", "node3"):
        info.run(host, "sudo -n systemctl stop meshdeploy-rpc-50052", check=True)
    try:
        s, _ = wait_state(info, lambda s: s["state"] == "down", 60)
        assert s["state"] == "down" and s["lost"] == ["node2", "node3"], s
        time.sleep(6)  # three of md-failover's 2 s rounds: still down, nothing started
        assert state(info)["state"] == "down"
        running = info.run("node1", "pgrep -c -x llama-server")
        assert running.stdout.strip() == "0", running.stdout
        body = json.dumps({"prompt": "x", "n_predict": 1})
        refused = subprocess.run(
            ["ip", "netns", "exec", net.host_netns(info.name, "node1"), "curl", "-s", "-m",
             "10", "-w", "\n%{http_code}", "-H", "Content-Type: application/json", "-d", body,
             "http://127.0.0.1:8080/completion"], capture_output=True, text=True, timeout=20)
        assert refused.stdout.endswith("\n503"), refused.stdout
        assert "down while node2, node3 are away" in refused.stdout, refused.stdout
        done = meshdeploy("status", lab[1], "--json", "--window", "0")
        assert done.returncode == DOWN, done.stdout + done.stderr
        rows = {(r["host"], r["service"]): r for r in json.loads(done.stdout)}
        assert rows[("node1", "failover main")]["answer"].startswith(
            "down while node2, node3 are away"), rows
        log = info.run("node1", "sudo -n journalctl -u meshdeploy-server-main --no-pager "
                                "| grep 'down while'")
        assert "down while node2, node3 are away: no placement without them" in log.stdout, \
            log.stdout + log.stderr
        info.run("node2", "sudo -n systemctl start meshdeploy-rpc-50052", check=True)
        s, _ = wait_state(info, lambda s: s["state"] == "serving", 60)
        assert s["lost"] == ["node3"], s
    finally:
        for host in ("node2", "node3"):
            info.run(host, "sudo -n systemctl start meshdeploy-rpc-50052")
    s, _ = wait_state(info, lambda s: s["lost"] == [] and s["state"] == "serving", 90)
    assert s["lost"] == [] and s["state"] == "serving", s
    wait_for_health(info, 60)
    assert complete(info)


def test_apply_limited_to_the_hosts_left_keeps_the_failover_in_force(lab):
    """A worker away (its link to node1 and its SSH cut, no RST): `apply --limit node1,node2`
    converges the hosts that are left, and md-failover stays on the placement without node3
    (the apply restarts nothing on a file that did not change); it goes back when node3 does."""
    info, path = lab
    node1 = info.host("node1").address
    assert wait_state(info, lambda s: s.get("state") == "serving" and not s["lost"], 60)[0]
    _nft(info, "node3", f"table inet {TABLE} {{\n"
                        "  chain input { type filter hook input priority -10; policy accept;\n"
                        f"    ip saddr {node1} drop\n    tcp dport 22 drop\n  }}\n"
                        "  chain output { type filter hook output priority -10; "
                        "policy accept;\n"
                        f"    ip daddr {node1} drop\n  }}\n}}\n")
    try:
        s, _ = wait_state(info, lambda s: s["lost"] == ["node3"] and s["state"] == "serving", 90)
        assert s["lost"] == ["node3"], s
        since = s.get("since")
        done = meshdeploy("apply", path, "--limit", "node1,node2", "--auto-approve")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr
        print(done.stdout[-1500:])
        s = state(info)
        assert s["lost"] == ["node3"] and s["state"] == "serving", s
        assert s.get("since") == since, (since, s)  # not restarted by the apply
        wait_for_health(info, 60)
        assert complete(info)
    finally:
        _nft(info, "node3", f"delete table inet {TABLE}\n")
    s, _ = wait_state(info, lambda s: s["lost"] == [] and s["state"] == "serving", 90)
    assert s["lost"] == [], s
