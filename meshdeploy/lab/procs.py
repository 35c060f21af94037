"""Background processes of a lab: started detached, recorded in pid files, found again by marks.

The machine has no systemd to supervise the lab, and a lab must be removable after the Python
process that started it died, so every process is either recorded in <state>/run/<name>.pid or
carries MESHDEPLOY_LAB_STATE=<state dir> in its environment (children inherit it), or both.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from meshdeploy.lab.errors import LabError


def spawn(argv: list[str], run_dir: Path, name: str, marker: str) -> int:
    """Start `argv` detached, logging to <run_dir>/<name>.log; `marker` is the lab state dir."""
    env = dict(os.environ, MESHDEPLOY_LAB_STATE=marker)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / f"{name}.log", "ab")
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives Ctrl-C of the caller; down() ends it
            env=env,
        )
    finally:
        log.close()
    (run_dir / f"{name}.pid").write_text(f"{proc.pid}\n")
    return proc.pid


def read_pid(run_dir: Path, name: str) -> int | None:
    try:
        return int((run_dir / f"{name}.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def running(run_dir: Path, name: str, marker: str) -> int | None:
    pid = read_pid(run_dir, name)
    # A recycled pid belongs to someone else: trust the pid file only with the lab's mark.
    if alive(pid) and environ_marker(pid) == marker:
        return pid
    return None


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def environ_marker(pid: int) -> str:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return ""
    for item in env:
        if item.startswith(b"MESHDEPLOY_LAB_STATE="):
            return item.split(b"=", 1)[1].decode(errors="replace")
    return ""


def pids_marked(marker: str) -> list[int]:
    """Processes carrying MESHDEPLOY_LAB_STATE=`marker` (the lab's own, however they were lost)."""
    me = os.getpid()
    return [
        int(e)
        for e in os.listdir("/proc")
        if e.isdigit() and int(e) != me and environ_marker(int(e)) == marker
    ]


def kill_all(pids: list[int], grace: float = 5.0) -> list[int]:
    """SIGTERM, wait up to `grace` seconds, then SIGKILL; returns pids still alive after that."""
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if alive(pid):
            _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_tcp(port: int, what: str, timeout: float = 20.0, pid: int | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if pid is not None and not alive(pid):
                break
            time.sleep(0.1)
    raise LabError(f"{what} did not start listening on 127.0.0.1:{port}; "
                   f"see {what}.log in the lab's run directory")
