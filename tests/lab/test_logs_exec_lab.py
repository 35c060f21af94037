"""`meshdeploy logs` and `meshdeploy exec` against real hosts: fabric through the lab's
ssh_config (ProxyCommand into each host's network namespace), real journald, real sudo.

Runs on the shared converged lab (conftest's converged_lab: node1 orchestrator, node2 and node3
workers, with mirrors). The host-key test reuses the lab's ssh_config with a strict policy
and an empty known_hosts of its own; the stopped-host test runs last and brings node3 back.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from support.cli import as_at_a_terminal, meshdeploy

from meshdeploy.errors import CONNECT, ERROR, OK

pytestmark = [pytest.mark.lab, pytest.mark.build]

LINE = re.compile(r"^(\S+) (\S+) +\| (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) (.*)$")
SERVICES = {("node1", "llama-server:main"), ("node2", "rpc-server:50052"),
            ("node3", "rpc-server:50052")}



@pytest.fixture(scope="module")
def fab(converged_lab):
    info, handle, _ = converged_lab
    return info, handle


@pytest.fixture(scope="module")
def cluster(converged_lab):
    return converged_lab[2]


def parsed(stdout: str) -> list[tuple[str, str, datetime, str]]:
    out = []
    for line in stdout.splitlines():
        m = LINE.match(line)
        assert m, f"not a log line: {line!r}"
        out.append((m[1], m[2], datetime.fromisoformat(m[3]), m[4]))
    return out


def journalctls(info) -> dict[str, str]:
    """journalctl processes left on each host (`pgrep -a`)."""
    return {h.name: info.run(h.name, "pgrep -a journalctl || true").stdout.strip()
            for h in info.hosts}


def test_logs_merges_all_services_in_time_order(fab, cluster):
    done = meshdeploy("logs", cluster, "-n", "5")
    assert done.returncode == OK, done.stderr
    lines = parsed(done.stdout)
    assert {(h, s) for h, s, _, _ in lines} == SERVICES
    times = [t for _, _, t, _ in lines]
    assert times == sorted(times)
    # -n is per service
    for service in SERVICES:
        assert sum((h, s) == service for h, s, _, _ in lines) == 5
    # node1's are its server unit's: llama-server's own (its --log-prefix/--log-timestamps
    # form) or md-failover's, which supervises it in that unit.
    own = re.compile(r"\d+\.\d\d\.\d{3}\.\d{3} [IWEDT] |md-failover: ")
    assert any(own.match(text) for h, _, _, text in lines if h == "node1"), lines


def test_logs_of_one_host_and_of_a_kind(fab, cluster):
    done = meshdeploy("logs", cluster, "node2", "-n", "3")
    assert done.returncode == OK, done.stderr
    assert {(h, s) for h, s, _, _ in parsed(done.stdout)} == {("node2", "rpc-server:50052")}
    done = meshdeploy("logs", cluster, "rpc-server", "-n", "2")
    assert {h for h, _, _, _ in parsed(done.stdout)} == {"node2", "node3"}
    done = meshdeploy("logs", cluster, "node9")
    assert done.returncode != OK and "node9: no host or service of that name" in done.stderr
    assert "Traceback" not in done.stderr


def test_logs_since_leaves_out_older_lines(fab, cluster):
    info, _ = fab
    restart = "sudo systemctl restart meshdeploy-rpc-50052"
    info.run("node2", restart, check=True)
    time.sleep(1.5)
    # The hosts share this machine's clock (and time zone): a second boundary between restarts.
    since = datetime.fromtimestamp(int(time.time()) + 1)
    time.sleep(max(0.0, since.timestamp() - time.time()) + 0.5)
    info.run("node2", restart, check=True)
    recent = meshdeploy("logs", cluster, "node2", "--since", since.isoformat(sep=" "))
    assert recent.returncode == OK, recent.stderr
    lines = parsed(recent.stdout)
    assert lines and all(t >= since for _, _, t, _ in lines)
    started = [t for _, _, t, text in lines if text.startswith("Started meshdeploy-rpc-50052")]
    assert len(started) == 1  # the second restart's, not the first's
    everything = meshdeploy("logs", cluster, "node2", "--since", "2020-01-01")
    assert len(parsed(everything.stdout)) > len(lines)
    assert len(parsed(meshdeploy("logs", cluster, "node2", "--since", "2020-01-01", "-n",
                                 "1").stdout)) == 1
    assert all(datetime.now() - t < timedelta(minutes=1) for _, _, t, _ in lines)


def test_follow_shows_new_lines_and_ctrl_c_leaves_no_journalctl(fab, cluster):
    info, _ = fab
    proc = subprocess.Popen([sys.executable, "-m", "meshdeploy", "logs", cluster, "-f", "-n", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, preexec_fn=as_at_a_terminal)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(journalctls(info).values()):
            time.sleep(0.5)
        running = journalctls(info)
        assert all(running.values()), running
        assert "-f" in running["node3"]
        restarted = time.time()
        info.run("node3", "sudo systemctl restart meshdeploy-rpc-50052", check=True)
        seen = []
        while time.time() < restarted + 30:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            seen.append(line)
            if line.startswith("node3 rpc-server:50052") and "Started meshdeploy-rpc-50052" in line:
                break
        else:
            pytest.fail(f"the restart never showed: {seen}")
        print(f"node3's restart shown {time.time() - restarted:.2f} s after it was asked for")
        interrupted = time.monotonic()
        proc.send_signal(signal.SIGINT)
        # Read on, as a terminal does (a full pipe would hold a writer in its last flush).
        proc.communicate(timeout=30)
        assert proc.returncode == OK
        print(f"logs -f exited {time.monotonic() - interrupted:.1f} s after Ctrl-C")
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(1)
    assert journalctls(info) == {"node1": "", "node2": "", "node3": ""}


def test_exec_runs_everywhere_with_a_table(fab, cluster):
    done = meshdeploy("exec", cluster, "--", "hostname")
    assert done.returncode == OK, done.stderr
    for n in ("node1", "node2", "node3"):
        assert re.search(rf"^== {n} \(exit 0, [\d.]+ s\) ==\n{n}$", done.stdout, re.M)
        assert re.search(rf"^{n}\s+0\s+[\d.]+\s*$", done.stdout, re.M)
    root = meshdeploy("exec", cluster, "--sudo", "--limit", "node2,node3", "--", "id", "-u")
    assert root.returncode == OK
    assert root.stdout.count("\n0\n") == 2 and "node1" not in root.stdout


def test_exec_failing_on_one_host_exits_1(fab, cluster):
    done = meshdeploy("exec", cluster, "--", 'test "$(hostname)" != node2 || { echo no; exit 3; }')
    assert done.returncode == ERROR
    assert re.search(r"^== node2 \(exit 3, [\d.]+ s\) ==\nno$", done.stdout, re.M)
    assert re.search(r"^node2\s+3\s", done.stdout, re.M)
    assert re.search(r"^node1\s+0\s", done.stdout, re.M)


def test_words_are_passed_literally(fab, cluster, tmp_path):
    done = meshdeploy("exec", cluster, "--limit", "node1", "--", "printf", "%s|", "$HOME",
                      "a b", "; touch /tmp/pwned")
    assert done.returncode == OK
    assert "$HOME|a b|; touch /tmp/pwned|" in done.stdout
    info, _ = fab
    assert info.run("node1", "test -e /tmp/pwned").returncode != 0


def test_strict_policy_with_empty_known_hosts_refuses_before_running(fab, cluster, tmp_path):
    info, _ = fab
    known = tmp_path / "known_hosts"
    config = tmp_path / "ssh_config"
    text = Path(info.ssh["config"]).read_text()
    config.write_text(text.replace("StrictHostKeyChecking no", "StrictHostKeyChecking yes")
                      .replace("UserKnownHostsFile /dev/null", f"UserKnownHostsFile {known}"))
    strict = tmp_path / "lab.yaml"
    strict.write_text(cluster.read_text().replace(info.ssh["config"], str(config)))
    env = {**os.environ, "HOME": str(tmp_path)}
    marker = f"/tmp/meshdeploy-ran-{time.time_ns()}"
    done = meshdeploy("exec", strict, "--", f"touch {marker}", env=env)
    assert done.returncode == CONNECT
    assert re.match(r"host key of node\d is unknown: node\d offered \S+ key SHA256:", done.stderr)
    assert "--accept-new-host-keys" in done.stderr and "Traceback" not in done.stderr
    for h in info.hosts:
        assert info.run(h.name, f"test -e {marker}").returncode != 0
    logs = meshdeploy("logs", strict, "node2", env=env)
    assert logs.returncode == CONNECT and "host key of node2 is unknown" in logs.stderr
    # accept-new records the keys, then the strict policy lets them in
    assert meshdeploy("exec", strict, "--accept-new-host-keys", "--", "true",
                      env=env).returncode == OK
    assert len(known.read_text().splitlines()) == 3
    assert meshdeploy("exec", strict, "--", "true", env=env).returncode == OK


def test_a_stopped_host_is_named_and_the_others_shown(fab, cluster):
    info, handle = fab
    subprocess.run(["ssh", "-F", info.ssh["config"], "node3", "sudo systemctl poweroff"],
                   capture_output=True, timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and info.run("node3", "true", timeout=10).returncode == 0:
        time.sleep(1)
    try:
        done = meshdeploy("logs", cluster, "-n", "2")
        assert done.returncode == OK, done.stderr
        assert re.search(r"^node3: unreachable \(.+\)$", done.stderr, re.M), done.stderr
        assert {h for h, _, _, _ in parsed(done.stdout)} == {"node1", "node2"}
        only = meshdeploy("logs", cluster, "node3")
        assert only.returncode == CONNECT and "node3: unreachable" in only.stderr
        ran = meshdeploy("exec", cluster, "--", "true")
        assert ran.returncode == CONNECT
        assert re.search(r"^node3\s+unreachable\s+-\s+\S", ran.stdout, re.M)
        assert re.search(r"^node1\s+0\s", ran.stdout, re.M)
    finally:
        handle.up()
