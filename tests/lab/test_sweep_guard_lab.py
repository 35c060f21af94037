"""bench --sweep when it is cut off, and when someone else takes the port it frees, on the
shared converged lab (conftest's converged_lab: node1 orchestrator, node2 and node3 workers).

- A sweep ended with SIGTERM in the middle of a split starts the deployed server again itself.
- A sweep whose SSH connection to node1 is cut (every packet to node1's sshd dropped) cannot;
  the orchestrator's dead-man timer starts the server by itself after --restart-after.
- A process of another user that binds the deployed server's port while the sweep has the
  server stopped is sent no request with the API key.

The time until the server answered again is printed (pytest -rP shows it).
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time

import pytest
from support.cli import meshdeploy
from test_bench_lab import deployed_argv, keyed_cluster

pytestmark = [pytest.mark.lab, pytest.mark.build]

COPY = "meshdeploy-sweep-main"
SQUATTER = "md-squatter"
# Answers 200 to anything and prints what it was sent (to its unit's journal).
SQUAT = r"""
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def answer(self):
        print("REQUEST", self.command, self.path, dict(self.headers), flush=True)
        size = int(self.headers.get("Content-Length") or 0)
        if size:
            self.rfile.read(size)
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_GET = do_POST = answer
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", 8080), H).serve_forever()
"""


@pytest.fixture(scope="module")
def lab(converged_lab):
    return converged_lab[0]


@pytest.fixture(scope="module")
def cluster_file(converged_lab):
    return converged_lab[2]


@pytest.fixture(autouse=True)
def server_back(lab, cluster_file):
    """After each test the deployed server runs again, whatever the test (or the code it
    tests) left: no copy, no timer, and no kept speeds beside the shared cluster file (they
    move later modules' placement)."""
    yield
    cluster_file.with_name(cluster_file.stem + ".speed.json").unlink(missing_ok=True)
    lab.run("node1", f"systemctl stop {COPY} 'meshdeploy-sweep-restart-*.timer'; "
                     "systemctl start meshdeploy-server-main", root=True)
    assert wait_healthy(lab, 120) is not None


def start_sweep(cluster_file, *extra) -> tuple[subprocess.Popen, list[str]]:
    """A sweep running, once it has stopped the deployed server and started its first split's
    copy; (the process, the stderr lines so far)."""
    proc = subprocess.Popen([sys.executable, "-m", "meshdeploy", "bench", str(cluster_file),
                             "--sweep", "--points", "3", "--runs", "2", "--no-local",
                             "--auto-approve", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    seen = []
    deadline = time.monotonic() + 300
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("split 1/"):
            break
        assert time.monotonic() < deadline, seen
    assert seen and seen[-1].startswith("split 1/"), seen
    return proc, seen


def healthy(lab) -> bool:
    """node1's llama-server answers /health, asked inside node1's network namespace from here
    (no SSH: the cut test drops node1's SSH)."""
    ns = lab.host("node1").netns
    return subprocess.run(["nsenter", f"--net=/run/netns/{ns}", "curl", "-sf", "-m", "2",
                           "http://127.0.0.1:8080/health"], capture_output=True).returncode == 0


def wait_healthy(lab, seconds: float) -> float | None:
    """Seconds until the server answered, or None when it did not within `seconds`."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if healthy(lab):
            return time.monotonic() - started
        time.sleep(1)
    return None


def active(lab, unit: str) -> str:
    return lab.run("node1", f"systemctl is-active {unit}").stdout.strip()


def test_a_sweep_ended_with_sigterm_starts_the_server_again(lab, cluster_file):
    before = deployed_argv(lab)
    proc, seen = start_sweep(cluster_file)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    back = wait_healthy(lab, 120)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    print(f"SIGTERM: llama-server answered again after {back} s")
    assert back is not None, "".join(seen)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    # Started by the sweep itself, not by the dead-man timer (600 s), which it cancelled.
    assert time.monotonic() - started < 240
    assert active(lab, COPY) != "active"
    timers = lab.run("node1", "systemctl list-units --all --no-legend "
                              "'meshdeploy-sweep-restart-*'").stdout
    assert timers.strip() == "", timers
    assert deployed_argv(lab) == before


def test_a_sweep_cut_off_from_the_orchestrator_leaves_the_server_answering(lab, cluster_file):
    before = deployed_argv(lab)
    ns = lab.host("node1").netns
    nft = ["nsenter", f"--net=/run/netns/{ns}", "nft"]
    proc, seen = start_sweep(cluster_file, "--restart-after", "60")
    cut = subprocess.run(nft + ["-f", "-"], input="table inet mdcut {\n chain in {\n"
                         "  type filter hook input priority -300;\n  tcp dport 22 drop\n }\n}\n",
                         text=True, capture_output=True)
    assert cut.returncode == 0, cut.stderr
    try:
        assert not healthy(lab)  # the sweep had it stopped
        back = wait_healthy(lab, 60 + 120)
        print(f"SSH cut: llama-server answered again {back} s after the cut (--restart-after "
              "60; the timer was armed as the split began, the cut came right after)")
    finally:
        subprocess.run(nft + ["delete", "table", "inet", "mdcut"], capture_output=True)
        proc.kill()
        proc.communicate(timeout=60)
    assert back is not None, "".join(seen)
    # The timer stopped the copy before it started the server, and is gone.
    assert active(lab, COPY) != "active"
    assert lab.run("node1", "systemctl list-timers --all --no-legend "
                            "'meshdeploy-sweep-restart-*'").stdout.strip() == ""
    assert deployed_argv(lab) == before


def test_a_squatter_on_the_freed_port_is_sent_no_key(lab, cluster_file):
    key, keyed = keyed_cluster(lab, cluster_file, "sweep-keyed")
    try:
        proc, seen = start_sweep(keyed)
        # Another user's process takes the port while the deployed server is stopped.
        squat = lab.run("node1", shlex.join(["systemd-run", "--unit", SQUATTER, "-p",
                                             "User=nobody", "--", "python3", "-c", SQUAT]),
                        root=True)
        assert squat.returncode == 0, squat.stderr
        time.sleep(2)
        assert active(lab, SQUATTER) == "active"
        out, err = proc.communicate(timeout=900)
        print("".join(seen) + err)
        # This run of the squatter's only (the unit's journal keeps earlier runs).
        run_id = lab.run("node1", f"systemctl show -p InvocationID --value {SQUATTER}",
                         root=True).stdout.strip()
        assert run_id, "the squatter has no invocation id"
        sent = lab.run("node1", f"journalctl _SYSTEMD_INVOCATION_ID={run_id} --no-pager -o cat",
                       root=True).stdout
        print(sent)
        assert key not in sent
        assert proc.returncode != 0 and f"/system.slice/{SQUATTER}.service" in err, err
        assert "nothing with the API key was sent to it" in err
    finally:
        lab.run("node1", f"systemctl stop {SQUATTER}; systemctl reset-failed {SQUATTER}",
                root=True)
        restored = meshdeploy("apply", cluster_file, "--auto-approve")
        assert restored.returncode == 0, restored.stderr
    assert wait_healthy(lab, 60) is not None
    assert json.loads(lab.run("node1", "curl -s http://127.0.0.1:8080/health").stdout)
