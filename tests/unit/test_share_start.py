"""The script that (re)starts md-share (core/share.py), run for real on this machine.

Without systemd (this machine is not booted with it) md-share runs as nobody; with systemd it is
a transient unit, checked here through stand-in systemd-run/systemctl commands that record their
arguments (test_unit_hardening scores the unit's settings, the lab runs the real thing).
"""

from __future__ import annotations

import http.client
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from test_md_share import free_port

from meshdeploy.core import share
from meshdeploy.core.paths import model_share_port

# A Debian root's PATH: its python3 is one that nobody may run (a pyenv shim under /root is not).
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ROOTED = (os.geteuid() == 0 and shutil.which("setpriv") and Path("/proc/self/status").exists()
          and shutil.which("python3", path=HOST_PATH))


@pytest.fixture
def place():
    """A folder nobody may traverse (pytest's tmp_path is 0700): md-share, a file it serves."""
    d = Path(tempfile.mkdtemp(prefix="md-share-start-", dir="/tmp"))
    d.chmod(0o755)
    (d / "tools").mkdir(mode=0o755)
    server = d / "tools" / "md-share.py"
    shutil.copy(share.SERVER, server)
    server.chmod(0o755)
    (d / "blob").write_bytes(os.urandom(4096))
    (d / "blob").chmod(0o644)
    started: list[subprocess.Popen] = []
    yield d, started
    for pid_file in d.glob("run*/md-share.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
    for proc in started:
        proc.kill()
        proc.wait()
    time.sleep(0.3)  # md-share as nobody removes its pid file, then the folder can go
    shutil.rmtree(d, ignore_errors=True)


def script(d: Path, port: int, **paths: str) -> str:
    args = ["--bind", "127.0.0.1", "--port", port, "--allow", "127.0.0.1",
            "--file", f"blob={d / 'blob'}", "--idle", 30, "--max", 60]
    where = {"PID": str(d / "run" / "md-share.pid"), "OLD_PID": str(d / "old" / "md-share.pid"),
             "LOG": str(d / "log" / "share.log"), "BOOTED": str(d / "no-systemd"), **paths}
    return share.start_script(str(d / "tools" / "md-share.py"), args, "node1", ["127.0.0.1"],
                              **where)


def run(text: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", text], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PATH": HOST_PATH, **env})


def get(port: int) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/models/blob", headers={"Range": "bytes=0-9"})
    r = conn.getresponse()
    assert r.status == 206
    body = r.read()
    conn.close()
    return body


def running(pid: int) -> bool:
    """Alive and not a zombie (the machine's init may be slow to reap what it inherits)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:")))


@pytest.mark.skipif(not ROOTED, reason="runs md-share as nobody: needs root, setpriv and /proc")
def test_without_systemd_it_runs_as_nobody_and_a_stale_pid_file_kills_nothing(place):
    d, started = place
    # Stale pid files (a reboot, a crash) that now name some other root process. Before, the
    # script killed whatever had that pid, as root.
    bystander = subprocess.Popen(["sleep", "60"])
    started.append(bystander)
    for folder in ("run", "old"):
        (d / folder).mkdir()
        (d / folder / "md-share.pid").write_text(f"{bystander.pid}\n")
    port = free_port()
    done = run(script(d, port))
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"md-share serving on port {model_share_port}\n"
    assert bystander.poll() is None  # alive
    assert not (d / "old" / "md-share.pid").exists()
    first = int((d / "run" / "md-share.pid").read_text())
    assert uid_of(first) == pwd.getpwnam("nobody").pw_uid
    blob = (d / "blob").read_bytes()
    assert get(port) == blob[:10]

    # A later start replaces the earlier one (whose pid file is genuine).
    done = run(script(d, port))
    assert done.returncode == 0, done.stderr
    second = int((d / "run" / "md-share.pid").read_text())
    assert second != first and not running(first)
    assert get(port) == blob[:10]
    assert bystander.poll() is None


@pytest.mark.skipif(not ROOTED, reason="runs md-share as nobody: needs root, setpriv and /proc")
def test_without_systemd_a_failed_start_says_why(place):
    d, _ = place
    # What held md-share's port on the lab: no listener, an outgoing connection of the host's
    # that the kernel gave that port as its source (SO_REUSEADDR does not get past it).
    # The port is md-share's own: the script names the sockets on it.
    busy = model_share_port
    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        try:
            client.bind(("127.0.0.1", busy))
        except OSError as e:
            pytest.skip(f"port {busy} is in use here: {e}")
        client.connect(server.getsockname())
        done = run(script(d, busy))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("node1: md-share did not start:\n"), done.stderr
    assert f"cannot listen on 127.0.0.1 port {busy}" in done.stderr
    if shutil.which("ss"):
        held = done.stderr.split(f"port {busy} is held by:\n", 1)[-1]
        assert held.startswith("ESTAB") and f"127.0.0.1:{busy} " in held, done.stderr


# Stand-ins: systemd-run records its arguments and starts the command it was given (as the
# unit would), systemctl stops/tells about it, journalctl says one line. $FAKE/loaded: how many
# more times `systemctl show` finds the stopped unit still loaded; $FAKE/taken: how many more
# times systemd-run finds its name taken.
COUNTDOWN = r"""countdown() {
  n=$(cat "$FAKE/$1" 2>/dev/null) || return 1
  [ "${n:-0}" -gt 0 ] || return 1
  echo $((n - 1)) > "$FAKE/$1"
}
"""
FAKE_RUN = r"""#!/bin/sh
""" + COUNTDOWN + r"""if countdown taken; then
  echo "Failed to start transient service unit: Unit meshdeploy-share.service was already loaded or has a fragment file." >&2
  exit 1
fi
printf '%s\n' "$@" > "$FAKE/run.args"
while [ $# -gt 0 ]; do case "$1" in -p) shift 2 ;; -*) shift ;; *) break ;; esac; done
[ -n "$FAKE_FAIL" ] && set -- "$@" --no-such-option
"$@" >>"$FAKE/unit.log" 2>&1 &
echo $! > "$FAKE/unit.pid"
"""
FAKE_CTL = r"""#!/bin/sh
""" + COUNTDOWN + r"""echo "$*" >> "$FAKE/systemctl.calls"
case "$1" in
  stop) [ -f "$FAKE/unit.pid" ] && kill "$(cat "$FAKE/unit.pid")" 2>/dev/null
    rm -f "$FAKE/unit.pid" ;;
  is-active) case "$(cat "/proc/$(cat "$FAKE/unit.pid")/stat" 2>/dev/null)" in
    ''|*") Z "*) exit 3 ;; esac ;;
  show) if countdown loaded; then echo loaded; else echo not-found; fi ;;
esac
exit 0
"""


def fake_systemd(d: Path) -> dict:
    bin_dir = d / "fake-bin"
    bin_dir.mkdir()
    for name, text in (("systemd-run", FAKE_RUN), ("systemctl", FAKE_CTL),
                       ("journalctl", "#!/bin/sh\necho 'the journal says why'\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (d / "booted").mkdir()
    return {"PATH": f"{bin_dir}:{HOST_PATH}", "FAKE": str(d)}


def test_under_systemd_it_is_a_transient_unit_with_the_hardening(place):
    d, _ = place
    env = fake_systemd(d)
    port = free_port()
    pid_file = d / "run-unit" / "md-share.pid"
    pid_file.parent.mkdir()  # RuntimeDirectory=, made by systemd
    text = script(d, port, BOOTED=str(d / "booted"), PID=str(pid_file))
    try:
        done = run(text, **env)
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"md-share serving on port {model_share_port}\n"
        assert get(port) == (d / "blob").read_bytes()[:10]
    finally:
        run("systemctl stop meshdeploy-share.service", **env)
    calls = (d / "systemctl.calls").read_text().splitlines()
    assert calls[0] == "stop meshdeploy-share.service"  # an earlier one goes first
    argv = (d / "run.args").read_text().splitlines()
    props = [argv[i + 1] for i, a in enumerate(argv) if a == "-p"]
    assert props == share.properties(["127.0.0.1"])
    assert "DynamicUser=yes" in props and "--unit=meshdeploy-share" in argv
    assert "--collect" in argv
    command = argv[argv.index("-p") + 2 * len(props):]
    assert command[0] == "--"  # what follows is the command, written so systemd expands nothing
    command = command[1:]
    assert command[0].startswith("/") and command[1:4] == [
        str(d / "tools" / "md-share.py"), "--pid-file", str(pid_file)]
    assert command[4:8] == ["--bind", "127.0.0.1", "--port", str(port)]
    assert not (d / "run").exists()  # nothing of the nobody route


def test_under_systemd_it_waits_until_the_earlier_unit_is_unloaded(place):
    """systemd-run refuses a name whose earlier unit systemd has not garbage-collected yet:
    the start waits (at most 5 s each time), resets a failed state each second, and takes the
    name again if systemd-run still finds it taken."""
    d, _ = place
    env = fake_systemd(d)
    port = free_port()
    pid_file = d / "run-unit" / "md-share.pid"
    pid_file.parent.mkdir()
    (d / "loaded").write_text("30\n")  # 3 s of polls
    (d / "taken").write_text("1\n")
    try:
        done = run(script(d, port, BOOTED=str(d / "booted"), PID=str(pid_file)), **env)
        assert done.returncode == 0, done.stderr
        assert get(port) == (d / "blob").read_bytes()[:10]
    finally:
        run("systemctl stop meshdeploy-share.service", **env)
    calls = (d / "systemctl.calls").read_text().splitlines()
    # 30 polls find it loaded, one not; after systemd-run found the name taken, one more.
    assert calls.count("show -p LoadState --value meshdeploy-share.service") == 32
    assert calls.count("reset-failed meshdeploy-share.service") == 1 + 3 + 1
    assert (d / "taken").read_text() == "0\n"


def test_under_systemd_a_name_that_stays_taken_fails_with_systemds_words(place):
    d, _ = place
    (d / "taken").write_text("5\n")
    done = run(script(d, free_port(), BOOTED=str(d / "booted"), PID=str(d / "run-unit" / "p")),
               **fake_systemd(d))
    assert done.returncode == 1
    assert done.stderr.count("was already loaded") == 1, done.stderr
    assert done.stderr.endswith("node1: md-share did not start (systemd-run)\n")
    assert (d / "taken").read_text() == "2\n"  # three tries


def test_under_systemd_a_failed_start_shows_the_log_and_the_journal(place):
    d, _ = place
    text = script(d, free_port(), BOOTED=str(d / "booted"), PID=str(d / "run-unit" / "x.pid"),
                  LOG=str(d / "unit.log"))
    done = run(text, **fake_systemd(d), FAKE_FAIL="1")
    assert done.returncode == 1
    assert done.stderr.startswith("node1: md-share did not start:\n"), done.stderr
    assert "unrecognized arguments: --no-such-option" in done.stderr
    assert done.stderr.endswith("the journal says why\n")


def test_properties_hold_ip_literals_only():
    props = share.properties(["10.0.0.7", "fd00::7", "name.example"])
    # systemd-run (252) takes no "localhost" keyword here, unlike a unit file.
    assert props[-2:] == ["IPAddressDeny=any",
                          "IPAddressAllow=127.0.0.0/8 ::1/128 10.0.0.7 fd00::7"]
    assert f"StandardOutput=append:{share.LOG}" in props
