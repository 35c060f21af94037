"""The /health wait after llama-server's restart ends early when the server keeps exiting.

Restart=always brings back a llama-server that exits; one that exits at once (a flag its build
does not know) would do so until health.retries x health.interval is spent. The wait reads
systemd's NRestarts for the unit (a stub here: the count moves on at every call, as a server
restarted every RestartSec would) and stops after services_health_exits restarts.
"""

from __future__ import annotations

import socket
import subprocess
from types import SimpleNamespace

from meshdeploy.roles.services import defaults as d
from meshdeploy.roles.services.orchestrator import health_wait


def closed_url() -> str:
    with socket.socket() as s:  # bound and closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def run_wait(tmp_path, systemctl: str, retries: int):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "systemctl").write_text("#!/bin/sh\n" + systemctl)
    (stubs / "systemctl").chmod(0o755)
    server = SimpleNamespace(health=SimpleNamespace(retries=retries, interval=0.05, budget=9),
                             local_url=closed_url(), unit_name="meshdeploy-server-main")
    return subprocess.run(["sh", "-c", health_wait(server, "echo journal-tail >&2")],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{stubs}:/usr/bin:/bin", "COUNT": str(tmp_path / "n")})


def test_a_server_that_keeps_exiting_ends_the_wait_after_its_fifth_restart(tmp_path):
    # NRestarts was 7 before this restart (it counts since the unit was loaded) and grows by one
    # at each look.
    counting = ('n=$(cat "$COUNT" 2>/dev/null || echo 7); echo $((n + 1)) > "$COUNT"; '
                'echo "$n"\n')
    done = run_wait(tmp_path, counting, retries=200)
    assert done.returncode == 1
    polls = done.stdout.count(" health ")
    assert polls == d.services_health_exits, done.stdout
    assert (f"meshdeploy-server-main: /health not 200 after {polls} of 200 polls: it exited "
            f"{d.services_health_exits} times since its restart (last: 000)") in done.stderr
    assert done.stderr.rstrip().endswith("journal-tail")


def test_a_server_that_stays_up_while_it_loads_gets_the_whole_budget(tmp_path):
    done = run_wait(tmp_path, "echo 7\n", retries=8)
    assert done.returncode == 1 and done.stdout.count(" health ") == 8
    assert "meshdeploy-server-main: /health not 200 after 9 s (last: 000)" in done.stderr


def test_without_systemd_the_whole_budget_is_waited(tmp_path):
    """launchd hosts, or systemctl answering nothing usable."""
    done = run_wait(tmp_path, "echo 'System has not been booted with systemd' >&2; exit 1\n",
                    retries=6)
    assert done.returncode == 1 and done.stdout.count(" health ") == 6
    assert "/health not 200 after 9 s" in done.stderr
