"""bench --sweep's trust boundaries without hosts: the dead-man timer on the orchestrator and
SIGTERM/SIGHUP (the deployed server comes back without the control machine), the host locks
held throughout, the API key sent only to a listener of the unit meant, the copies' sandbox and
argv, and what speed.json and a split's error may put on the terminal. The lab runs the same
against real hosts: tests/lab/test_sweep_guard_lab.py."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.require import require
from test_bench_sweep import (  # noqa: F401 (fakes: a fixture)
    BOTH,
    RUNNING,
    FakeCopy,
    Server,
    fakes,
    remote,
    result,
    summary,
)

from meshdeploy.commands import bench, common
from meshdeploy.core.loading import load_cluster
from meshdeploy.engine import hosts as cluster_hosts
from meshdeploy.engine import server_api, speeds, sweep, sweep_guard
from meshdeploy.errors import terminal_text
from meshdeploy.placement import layout
from meshdeploy.roles.services import unit_files
from meshdeploy.roles.services.argv import llama_server_argv
from meshdeploy.views import sweep as view

REPO = Path(__file__).resolve().parents[2]
SPLITS = sweep.candidates(18, ["a", "b"], 3)


@pytest.fixture
def log(fakes, monkeypatch):
    """test_bench_sweep's fakes, with copies that all load."""
    monkeypatch.setattr(server_api, "Copy", lambda *a: FakeCopy(fakes))
    return fakes


def run_sweep(**kw):
    return sweep._sweep(None, True, None, Server(), None, RUNNING, SPLITS, 1, lambda line: None,
                        **kw)


# -- the dead-man timer --------------------------------------------------------------------------

def test_a_timer_is_armed_before_the_server_stops_and_again_before_every_step(log, monkeypatch):
    monkeypatch.setattr(server_api, "measure", lambda api, runs, n, progress: summary(50.0, 9.0))
    run_sweep(last=lambda: log.append(("last",)))
    order = [e for e in log if e[0] in ("arm", "cancel", "start copy", "last")
             or e == ("run", "systemctl stop meshdeploy-server-m")]
    a, b = "meshdeploy-sweep-restart-m-0", "meshdeploy-sweep-restart-m-1"
    # The next timer is armed before the one before it is cancelled: one is always armed.
    assert order == [
        ("cancel", BOTH), ("arm", a), ("run", "systemctl stop meshdeploy-server-m"),
        ("arm", b), ("cancel", a), ("start copy", "10,9"),
        ("arm", a), ("cancel", b), ("start copy", "12,7"),
        ("arm", b), ("cancel", a), ("start copy", "7,12"),
        ("arm", a), ("cancel", b), ("last",),
        ("cancel", BOTH)]
    assert log[-3:] == [("run", "systemctl start meshdeploy-server-m"), ("cancel", BOTH),
                        ("healthy", 8080)]


class _Shell:
    """run_remote's connection: the command run by sh here, with `path` first on PATH."""

    def __init__(self, path: Path):
        self.path, self.original_host = path, "node1"

    def run(self, command, **_):
        env = {**os.environ, "PATH": f"{self.path}:{os.environ['PATH']}"}
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)
        return SimpleNamespace(exited=done.returncode, stdout=done.stdout, stderr=done.stderr)


def stub(folder: Path, name: str, body: str) -> None:
    (folder / name).write_text("#!/bin/sh\n" + body)
    (folder / name).chmod(0o755)


def test_the_timer_starts_the_deployed_unit_after_stopping_the_copies(tmp_path):
    """The script Deadman.arm sends, run by a shell, with systemd-run and systemctl stubbed:
    the words systemd-run gets (a unit name quoted through core.shell arrives whole)."""
    stub(tmp_path, "systemd-run", f'printf "%s\\n" "$@" > {tmp_path}/argv\n')
    stub(tmp_path, "systemctl", 'echo not-found\n')
    server = SimpleNamespace(name="m x'y", unit_name="meshdeploy-server-m x'y")
    guard = sweep_guard.Deadman(_Shell(tmp_path), False, server, 75, ["copy-a", "copy-b"])
    guard.arm()
    assert (tmp_path / "argv").read_text().splitlines() == [
        "--quiet", "--unit", "meshdeploy-sweep-restart-m x'y-0", "--on-active=75s",
        "--timer-property=AccuracySec=1s", "-p", "ExecStartPre=-systemctl stop copy-a copy-b",
        "--", "systemctl", "start", "meshdeploy-server-m x'y"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_end_the_sweep_and_the_server_is_started_again(log, monkeypatch,
                                                                         signum):
    before = signal.getsignal(signum)

    def killed(api, runs, n, progress):
        os.kill(os.getpid(), signum)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("the signal was not handled")
    monkeypatch.setattr(server_api, "measure", killed)
    with pytest.raises(KeyboardInterrupt, match=signal.Signals(signum).name):
        run_sweep()
    assert log[-4:] == [("stop copy",), ("run", "systemctl start meshdeploy-server-m"),
                        ("cancel", BOTH), ("healthy", 8080)]
    assert signal.getsignal(signum) == before


def test_a_signal_while_the_server_is_started_again_does_not_stop_that(log, monkeypatch):
    monkeypatch.setattr(server_api, "measure", lambda api, runs, n, progress: summary(50.0, 9.0))
    plain = remote(log)

    def run(conn, command, sudo=False):
        if command == "systemctl start meshdeploy-server-m":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        return plain(conn, command, sudo)
    monkeypatch.setattr(server_api, "run_remote", run)
    run_sweep()
    assert log[-3:] == [("run", "systemctl start meshdeploy-server-m"), ("cancel", BOTH),
                        ("healthy", 8080)]


def test_a_lost_connection_leaves_the_timer_armed_and_says_so(log, monkeypatch):
    monkeypatch.setattr(server_api, "measure", lambda api, runs, n, progress: summary(50.0, 9.0))
    plain = remote(log)

    def run(conn, command, sudo=False):
        if command == "systemctl start meshdeploy-server-m":
            raise EOFError("SSH session not active")
        return plain(conn, command, sudo)
    monkeypatch.setattr(server_api, "run_remote", run)
    with pytest.raises(server_api.BenchError) as caught:
        run_sweep(seconds=90)
    assert str(caught.value) == ("node1: could not start meshdeploy-server-m again: SSH session "
                                 "not active")
    assert caught.value.hint == ("the orchestrator starts it by itself within 90 s (systemd "
                                 "timer meshdeploy-sweep-restart-m-1)")
    # Only the leftovers were cancelled, at the start: the last timer armed stays armed.
    assert log.count(("cancel", BOTH)) == 1 and log[0] == ("cancel", BOTH)
    assert ("cancel", "meshdeploy-sweep-restart-m-1") not in log[log.index(
        ("arm", "meshdeploy-sweep-restart-m-1"), len(log) - 6):]


def test_a_step_longer_than_the_deadline_ends_the_sweep(log, monkeypatch):
    monkeypatch.setattr(server_api, "run_remote", remote(log, deployed="active"))
    with pytest.raises(server_api.BenchError, match="runs again in the middle of the sweep: a "
                                                    "step took longer than --restart-after 60 s"):
        run_sweep(seconds=60)
    assert not [e for e in log if e[0] == "start copy"]
    assert log[-3:] == [("run", "systemctl start meshdeploy-server-m"), ("cancel", BOTH),
                        ("healthy", 8080)]


def test_restart_after_below_a_split_is_refused_before_anything_stops():
    proc = subprocess.run([os.sys.executable, "-m", "meshdeploy", "bench", "inventories/lab.yaml",
                           "--sweep", "--restart-after", "5", "--auto-approve"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("--restart-after must be at least 30 seconds")
    assert "Traceback" not in proc.stderr
    outside = subprocess.run([os.sys.executable, "-m", "meshdeploy", "bench",
                              "inventories/lab.yaml", "--restart-after", "60"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert outside.stderr.startswith("--restart-after is an option of --sweep"), outside.stderr


# -- the host locks ------------------------------------------------------------------------------

def test_the_sweep_holds_every_host_lock_of_its_servers_throughout(tmp_path, monkeypatch):
    shutil.copy(REPO / "inventories/lab.yaml", tmp_path / "lab.yaml")
    cluster = load_cluster(tmp_path / "lab.yaml")
    events = []
    session = SimpleNamespace(close=lambda: events.append("session closed"))

    def open_session(cluster, limit, accept):
        events.append(("session", tuple(limit)))
        return session
    monkeypatch.setattr(cluster_hosts, "open_session", open_session)
    monkeypatch.setattr(common.Locked, "hosts",
                        lambda self, s: events.append("hosts locked") if s is session else None)
    monkeypatch.setattr(common.Locked, "release_hosts",
                        lambda self: events.append("hosts released"))

    def sweep_server(cluster, server, settings, runs, points, local, progress, seconds):
        events.append(("sweep", server.name, seconds))
        return {"server": server.name, "host": server.host, "skipped": "measured elsewhere"}
    monkeypatch.setattr(sweep, "sweep_server", sweep_server)
    args = SimpleNamespace(points=3, json=False, auto_approve=True, restart_after=120,
                           accept_new_host_keys=False, runs=1, no_local=True)
    bench.run_sweep(args, cluster, cluster.servers, lambda line: None)
    assert events == [("session", ("node1", "node2", "node3")), "hosts locked",
                      ("sweep", "main", 120), "hosts released", "session closed",
                      "hosts released"]  # again by Locked on leaving: a no-op by then


# -- the API key goes only to the unit's own listener ---------------------------------------------

def _mine() -> str:
    """This process's cgroup as md_owner reads it (the first 0:: or name=systemd line)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    return next(line.split(":", 2)[2] for line in lines
                if line.startswith("0::") or ":name=systemd:" in line)


def owner_check(tmp_path, unit_cgroup: str, *held: str) -> str | None:
    """md_owner run here with ss and systemctl stubbed: `held` are ss's listeners ("LOCAL" held
    by this process, or "LOCAL -": no process named), the unit's cgroup is `unit_cgroup`."""
    rows = "".join(f"LISTEN 0 128 {local.split()[0]} 0.0.0.0:* "
                   + ("" if local.endswith(" -") else f'users:(("x",pid={os.getpid()},fd=3))')
                   + "\n" for local in held)
    stub(tmp_path, "ss", f"printf '{rows.replace('%', '%%')}'\n")
    stub(tmp_path, "systemctl", f"echo '{unit_cgroup}'\n")
    api = server_api.Api(_Shell(tmp_path), "127.0.0.1", 8080, "k", unit="meshdeploy-server-m")
    try:
        api.owned()
    except server_api.BenchError as exc:
        return str(exc).split("127.0.0.1:8080: ", 1)[1].split("; nothing with")[0]
    return None


def test_a_listener_is_the_units_only_when_every_one_on_the_port_is_in_its_cgroup(tmp_path):
    own, unit = _mine(), "meshdeploy-server-m"
    assert owner_check(tmp_path, own, "127.0.0.1:8080") is None
    assert owner_check(tmp_path, own, "0.0.0.0:8080", "[::]:8080") is None
    assert owner_check(tmp_path, own, "0.0.0.0%lo:8080", "[::ffff:127.0.0.1]:8080") is None
    # Someone else's: another cgroup on the address or the wildcard, or a cgroup whose path
    # only ends like the unit's.
    for local in ["127.0.0.1:8080", "*:8080", "[::ffff:127.0.0.1]:8080"]:
        for unit_cgroup in ["/system.slice/meshdeploy-server-m.service", f"/x{own}"]:
            assert owner_check(tmp_path, unit_cgroup, local) == (
                f"it is held by cgroup {own}, not by {unit} ({unit_cgroup}): another process "
                "took the port"), local
    # One of two listeners is enough; one whose process ss does not name is not the unit's.
    assert owner_check(tmp_path, own, "127.0.0.1:8080", "[::]:8080 -") == (
        f"it is held by cgroup ?, not by {unit} ({own}): another process took the port")
    assert owner_check(tmp_path, "", "127.0.0.1:8080") == (
        f"it is held by cgroup {own}, not by {unit} (which is not running): another process "
        "took the port")
    assert owner_check(tmp_path, own, "10.0.0.1:8080") == "nothing listens there"
    assert owner_check(tmp_path, own) == "nothing listens there"
    stub(tmp_path, "ss", "echo 'Cannot open netlink socket: Permission denied' >&2; exit 1\n")
    api = server_api.Api(_Shell(tmp_path), "127.0.0.1", 8080, "k", unit="meshdeploy-server-m")
    with pytest.raises(server_api.BenchError, match="ss could not list the port's listeners"):
        api.owned()


def test_without_ss_nothing_is_sent():
    assert server_api.foreign_listener(["unit /x", "no-ss"], "u") == \
        "the host has no ss (iproute2) to tell who holds it"


def test_the_owner_script_names_the_cgroup_of_the_process_that_listens(tmp_path):
    """_OWNER run here, against a real listener of this process: ss -p gives its pid, and its
    /proc/PID/cgroup the cgroup compared with the unit's (systemctl stubbed to say it)."""
    require("ss")
    mine = _mine()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        for unit_cgroup, expected in [(mine, None), ("/system.slice/other.service", mine)]:
            stub(tmp_path, "systemctl", f"echo '{unit_cgroup}'\n")
            api = server_api.Api(_Shell(tmp_path), "127.0.0.1", port, "k", unit="other")
            if expected is None:
                api.owned()
                continue
            with pytest.raises(server_api.BenchError, match=f"held by cgroup {expected}, not "
                                                            "by other"):
                api.owned()
    finally:
        listener.close()


def test_a_rootless_runit_service_owns_the_port_only_through_its_process_tree(tmp_path):
    """bench on a rootless runit host: the listener (this process) must be the service's pid
    as `sv status` says it, or a descendant of it; another pid gets an error, no key."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    layout = SimpleNamespace(manager="runit", services=str(tmp_path / "sv"))
    try:
        for service_pid in [os.getpid(), os.getppid(), 1]:
            stub(tmp_path, "sv", f'echo "run: $2: (pid {service_pid}) 9s; run: log: (pid '
                                 f'{os.getpid()}) 9s"\n')
            api = server_api.Api(_Shell(tmp_path), "127.0.0.1", port, "k",
                                 unit="meshdeploy-server-m", layout=layout)
            if service_pid != 1:  # this process, or its parent's child
                api.owned()
                continue
            with pytest.raises(server_api.BenchError,
                               match=f"held by process {os.getpid()}, not by "
                                     r"meshdeploy-server-m \(pid 1\)"):
                api.owned()
    finally:
        listener.close()


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.seen.append((self.path, self.headers.get("Authorization")))
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


class _Dialer:
    """An SSH connection's stand-in: dials here; the owner script answers `held`."""

    original_host = "node1"

    def __init__(self, held: str):
        self.held = held

    def dial(self, address, port, timeout):
        return socket.create_connection((address, port), timeout=timeout)

    def run(self, command, **_):
        return SimpleNamespace(exited=0, stdout=self.held, stderr="")


@pytest.fixture
def squatter():
    _Recorder.seen = []
    server = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_squatter_on_the_port_gets_health_checks_without_the_key_and_nothing_else(squatter):
    own = "/system.slice/meshdeploy-server-m.service"
    held = f"unit {own}\nforeign /system.slice/squat.service\n"  # md_owner's answer
    api = server_api.Api(_Dialer(held), "127.0.0.1", squatter, "secret-key",
                         unit="meshdeploy-server-m", sudo=True)
    with pytest.raises(server_api.BenchError, match="held by cgroup /system.slice/squat.service"):
        api.wait_healthy(5)
    with pytest.raises(server_api.BenchError, match="nothing with the API key was sent to it"):
        api.call("POST", "/completion", {})
    assert _Recorder.seen == [("/health", None)]
    # The unit's own listener gets the key.
    ours = f"unit {own}\nowned\n"
    api = server_api.Api(_Dialer(ours), "127.0.0.1", squatter, "secret-key",
                         unit="meshdeploy-server-m", sudo=True)
    api.wait_healthy(5)
    assert api.call("GET", "/props")[0] == 200
    assert _Recorder.seen[1:] == [("/health", None), ("/props", "Bearer secret-key")]


# -- the copies: the deployed unit's sandbox, the argv the plan renders ---------------------------

@pytest.fixture(scope="module")
def lab_cluster():
    return load_cluster(REPO / "inventories/lab.yaml")


class _Runs:
    """A connection that answers every command with `out` and keeps what it was sent."""

    original_host = "node1"

    def __init__(self, out: str = ""):
        self.out, self.sent = out, []

    def run(self, command, **_):
        self.sent.append(command)
        return SimpleNamespace(exited=0, stdout=self.out, stderr="")


def test_a_copy_runs_in_the_deployed_units_sandbox(lab_cluster):
    server = lab_cluster.servers[0]
    host = lab_cluster.host(server.host)
    unit = unit_files.server_unit(lab_cluster, host, server, "/b", None, None)
    settings = [line for line in unit.split("[Service]\n")[1].split("\n[")[0].splitlines()
                if "=" in line and not line.startswith("#")]
    conn = _Runs()
    copy = server_api.Copy(conn, False, lab_cluster, server, "meshdeploy-sweep-main", None)
    assert copy.props[-1] == f"RuntimeMaxSec={server_api.COPY_MAX_SECONDS}"
    taken = [p.replace("127.0.0.0/8 ::1", "localhost") for p in copy.props[:-1]]
    left = {line.split("=", 1)[0] for line in settings if line not in taken}
    assert left == {"Type", "ExecStart", "Restart", "RestartSec"}
    for wanted in ("DynamicUser=yes", "ProtectSystem=strict", "ProtectHome=read-only",
                   "SystemCallFilter=~@privileged", "CapabilityBoundingSet=",
                   "IPAddressDeny=any", "PrivateDevices=yes"):
        assert wanted in copy.props
    copy.start(["/b/llama-server", "-m", "x"])
    started = next(c for c in conn.sent if "systemd-run" in c)
    assert "-p ProtectSystem=strict" in started and "-p 'SystemCallFilter=~@privileged'" in started
    assert "localhost" not in started  # systemd-run takes address prefixes only


def test_a_keyed_copy_gets_the_key_as_a_credential_and_nothing_else_of_it(lab_cluster):
    from dataclasses import replace

    server = replace(lab_cluster.servers[0], api_key_file="/etc/k/key")
    keyed = server_api.Copy(_Runs(), False, lab_cluster, server, "meshdeploy-sweep-main", "k")
    assert "LoadCredential=api-key:/etc/k/key" in keyed.props
    assert keyed.key_path == "/run/credentials/meshdeploy-sweep-main.service/api-key"
    plain = server_api.Copy(_Runs(), False, lab_cluster, server, "meshdeploy-sweep-main", None)
    assert not [p for p in plain.props if p.startswith("LoadCredential=")]


def test_the_copies_argv_is_the_one_the_plan_renders_not_the_processs(lab_cluster):
    server = lab_cluster.servers[0]
    host = lab_cluster.host(server.host)
    prefix = host.layout.prefix
    conn = _Runs("== k1\ncommit=abc\nflags=--host --port -m --rpc -ngl -c -ts --metrics\n"
                 f"== k2\nflags=-m\ncurrent={prefix}/builds/k1\n")
    argv = server_api.planned_argv(conn, lab_cluster, server)
    from meshdeploy.core.paths import model_path

    assert argv == llama_server_argv(
        f"{prefix}/builds/k1/bin/llama-server", lab_cluster, server,
        model_path(lab_cluster, server.model, host),
        frozenset({"--host", "--port", "-m", "--rpc", "-ngl", "-c", "-ts", "--metrics"}))
    assert "--rpc" in argv and "--metrics" in argv
    assert not [c for c in conn.sent if "/proc/" in c or "cmdline" in c]
    with pytest.raises(server_api.BenchError, match="node1 has no current llama.cpp build"):
        server_api.planned_argv(_Runs("current=\n"), lab_cluster, server)


# -- what reaches the terminal; numbers no float holds --------------------------------------------

HOSTILE = "\x1b]52;c;cHduZWQ=\x07\x9b31m"


def test_a_splits_error_from_a_host_is_shown_not_run_by_the_terminal():
    r = result()
    r["splits"][1] = {**r["splits"][1], "loaded": False, "error": f"failed {HOSTILE} (see)"}
    text = view.render_text([r])
    assert HOSTILE not in text and terminal_text(HOSTILE) in text
    skipped = view.render_text([{"server": "m", "host": "h", "skipped": HOSTILE}])
    assert "\x1b" not in skipped and "\x9b" not in skipped


def write_speeds(tmp_path: Path, entry_text: str) -> Path:
    cluster = tmp_path / "c.yaml"
    speeds.path(cluster).write_text('{"format_version": 1, "servers": {"main": %s}}'
                                    % entry_text)
    return cluster


GOOD = {"devices": ["a", "b"], "commit": "c", "model": "m", "points": 3, "rtt": [0.001, 0.0],
        "gen": [1e-9, 2e-9], "prompt": None, "measured_at": "2026-11-28T21:00:00+00:00"}


@pytest.mark.parametrize("number", ["1" * 400, "1e400", "NaN", "-Infinity"])
def test_a_number_no_float_holds_in_speed_json_is_speeds_the_plan_cannot_read(tmp_path,
                                                                               number):
    text = json.dumps(GOOD).replace("[1e-09, 2e-09]", f"[{number}, 2e-09]")
    assert number in text
    entry = speeds.read(write_speeds(tmp_path, text))["main"]
    cal, why = layout.current_calibration(entry, ["a", "b"], "c", [])
    assert cal is None and why == "its kept device speeds cannot be read"


def test_measured_at_is_a_time_or_nothing(tmp_path):
    read = speeds.read(write_speeds(tmp_path, json.dumps(GOOD)))["main"]
    assert read["measured_at"] == "2026-11-28T21:00:00+00:00"
    odd = {**GOOD, "measured_at": f"2026-11-28{HOSTILE}"}
    assert "measured_at" not in speeds.read(write_speeds(tmp_path, json.dumps(odd)))["main"]
    # fromisoformat takes any one character between date and time: it comes back as "T".
    sep = {**GOOD, "measured_at": "2026-11-28\x1b21:00:00"}
    assert speeds.read(write_speeds(tmp_path, json.dumps(sep)))["main"]["measured_at"] == \
        "2026-11-28T21:00:00"
