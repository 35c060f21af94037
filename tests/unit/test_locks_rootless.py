"""The host lock and the guarded steps' markers on hosts without root (issue 22): both live in
the host's run folder (Layout.run) instead of /run/meshdeploy, and work as the login user. The
scripts run for real as a user without root (nobody, when this runs as root) in folders that
user owns: acquire, refresh, release, a stale lock's take-over with its orphaned step stopped,
a second Ctrl-C's stop, and the message when the run folder cannot be made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.nonroot import as_user, owned_folder
from support.require import require

from meshdeploy.config.model import RUNIT, SYSTEMD_USER, Layout, system_layout
from meshdeploy.core import inflight, share
from meshdeploy.engine import locks
from meshdeploy.errors import PlanError
from meshdeploy.execute.interrupt import Interrupts

@pytest.fixture(autouse=True)
def _tools():
    require("flock", "setsid")


@pytest.fixture
def home():
    folder = owned_folder()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def user_layout(home: Path, run: str | None = None) -> Layout:
    return Layout(prefix=f"{home}/.local/share/meshdeploy", cache=f"{home}/.cache/meshdeploy",
                  run=run or f"{home}/runtime/meshdeploy", services=f"{home}/service",
                  manager=RUNIT, home=str(home))


@dataclass
class Host:
    name: str
    layout: Layout


class Out:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.stdout_lines = proc.stdout.splitlines()
        self.stderr_lines = proc.stderr.splitlines()


class Session:
    """What HostLocks and Interrupts use of a session: the hosts, and run() on one of them,
    here as the user without root."""

    def __init__(self, *hosts: Host):
        self.hosts = hosts
        self.scripts: list[str] = []

    def reached(self):
        return list(self.hosts)

    def run(self, name, script):
        self.scripts.append(script)
        proc = subprocess.run(as_user(["sh", "-c", script]), capture_output=True, text=True,
                              timeout=60)
        return proc.returncode == 0, Out(proc)


def test_the_paths_come_from_the_hosts_layout():
    user = Layout(prefix="/home/md/.local/share/meshdeploy", cache="/home/md/.cache/meshdeploy",
                  run="/run/user/1000/meshdeploy", services="/home/md/.config/systemd/user",
                  manager=SYSTEMD_USER, home="/home/md")
    assert locks.host_lock(user) == "/run/user/1000/meshdeploy/apply.lock"
    assert inflight.steps_dir(user) == "/run/user/1000/meshdeploy/steps"
    assert "DIR=/run/user/1000/meshdeploy/steps" in inflight.guarded("llama_cpp.build", "true",
                                                                     user)
    assert "DIR=/run/user/1000/meshdeploy/steps" in inflight.stop_script(layout=user)
    # A host with root keeps /run/meshdeploy, whichever way it is asked.
    root = system_layout("/opt/meshdeploy")
    for layout in (root, None):
        assert locks.host_lock(layout) == locks.HOST_LOCK == "/run/meshdeploy/apply.lock"
        assert inflight.steps_dir(layout) == inflight.STEPS_DIR == "/run/meshdeploy/steps"
    assert inflight.guarded("x", "true", root) == inflight.guarded("x", "true")
    assert inflight.stop_script(layout=root) == inflight.stop_script()


def test_the_lock_is_taken_refreshed_and_released_without_root(home):
    layout = user_layout(home)
    lock = Path(layout.run) / "apply.lock"
    session = Session(Host("phone", layout))
    holder = locks.me("apply")
    with locks.HostLocks(session, holder, notes=lambda _: None) as held:
        assert held.held == ["phone"]
        assert locks.Holder.parse((lock / "owner").read_text()) == holder
        assert os.stat(lock).st_uid == os.stat(home).st_uid  # the user's, not root's
        # A second run finds it held, by whom, and fails at once.
        with pytest.raises(locks.LockedError) as info:
            locks.HostLocks(Session(Host("phone", layout)), locks.me("apply"),
                            notes=lambda _: None).__enter__()
        assert f"the cluster is locked by {holder.describe()}" in str(info.value)
        old = time.time() - 60
        os.utime(lock / "owner", (old, old))
        ok, _ = session.run("phone", locks.refresh_script(holder, held.lock("phone")))
        assert ok and (lock / "owner").stat().st_mtime > old + 30
    assert not lock.exists()
    assert not [s for s in session.scripts if "/run/meshdeploy" in s]


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)


def _orphan(layout: Layout) -> subprocess.Popen:
    """A guarded build left running by a dead run, as the user; returns once it holds its lock."""
    proc = subprocess.Popen(as_user(["sh", "-c", inflight.guarded("llama_cpp.build",
                                                                  "sleep 300", layout)]),
                            start_new_session=True)
    pid_file = Path(inflight.steps_dir(layout)) / "llama_cpp.build.pid"
    for _ in range(100):
        if pid_file.exists() and pid_file.read_text().count("\n") == 2:
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the guarded step did not start")


def test_a_stale_lock_is_taken_over_and_its_orphan_stopped_without_root(home):
    layout = user_layout(home)
    session = Session(Host("phone", layout))
    gone = locks.Holder(_dead_pid(), locks.me("x").machine, "ann", "2026-01-01T00:00:00Z",
                        "apply", "deadbeef")
    assert session.run("phone", locks.acquire_script(gone, lock=locks.host_lock(layout)))[0]
    orphan = _orphan(layout)
    notes = []
    try:
        with locks.HostLocks(session, locks.me("apply"), notes=notes.append) as held:
            assert held.held == ["phone"]
        assert notes[0].startswith("phone: took over a stale lock (meshdeploy apply of ann@")
        assert notes[1:] == ["phone: stopped llama_cpp.build, left running by that run"]
        assert orphan.wait(timeout=30) is not None
    finally:
        if orphan.poll() is None:
            os.killpg(orphan.pid, 9)


def test_a_second_ctrl_c_stops_the_steps_in_the_users_run_folder(home):
    layout = user_layout(home)
    orphan = _orphan(layout)
    try:
        interrupts = Interrupts(Session(Host("phone", layout)), notes=lambda _: None)
        interrupts._stop_all()
        assert interrupts.stopped == ["phone: llama_cpp.build"]
        assert orphan.wait(timeout=30) is not None
    finally:
        if orphan.poll() is None:
            os.killpg(orphan.pid, 9)


def test_a_run_folder_the_user_cannot_make_is_named(home):
    if os.geteuid() != 0:
        pytest.skip("needs a folder another user owns")
    walled = home / "walled"
    walled.mkdir(mode=0o755)
    os.chown(walled, 0, 0)  # root's: the user may not make its run folder there
    layout = user_layout(home, run=f"{walled}/meshdeploy")
    with pytest.raises(PlanError) as info:
        locks.HostLocks(Session(Host("phone", layout)), locks.me("apply"),
                        notes=lambda _: None).__enter__()
    assert str(info.value).startswith(f"phone: cannot take the lock {walled}/meshdeploy/"
                                      "apply.lock: ")
    assert "Permission denied" in str(info.value)
    assert f"must be able to make {walled}/meshdeploy" in info.value.hint
    assert "ssh.sudo" not in info.value.hint


def test_release_leaves_no_empty_folder_of_meshdeploy_in_the_users_home(home):
    """After destroy --purge the roles emptied the layout's folders; the lock's release removes
    them (and the run folder that held the lock). A folder that still holds something stays."""
    layout = user_layout(home, run=f"{home}/.cache/meshdeploy/run")  # Termux: no runtime dir
    holder = locks.me("destroy")
    acquired = subprocess.run(as_user(["sh", "-c", locks.acquire_script(
        holder, lock=locks.host_lock(layout))]), capture_output=True, text=True)
    assert acquired.stdout.strip() == "acquired", acquired.stderr
    for folder in (f"{layout.run}/steps", f"{layout.cache}/log", layout.prefix):
        subprocess.run(as_user(["mkdir", "-p", folder]), check=True)
    # What finished steps leave (their lock and pid files) and an md-share that exited idle.
    steps = Path(f"{layout.run}/steps")
    gone = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True).stdout.strip()
    for name, text in (("build.lock", ""), ("build.pid", gone), ("clone.lock", "")):
        subprocess.run(as_user(["sh", "-c", f"printf %s {text or chr(39) * 2} > {steps}/{name}"]),
                       check=True)
    subprocess.run(as_user(["sh", "-c", f"echo {gone} > {layout.run}/md-share.pid"]), check=True)
    # A step still running holds its lock: its files stay, and so do the folders above them.
    holding = subprocess.Popen(as_user(["flock", str(steps / "clone.lock"), "sleep", "30"]),
                               start_new_session=True)
    try:
        time.sleep(0.5)
        release = locks.release_script(holder, locks.host_lock(layout), layout)
        subprocess.run(as_user(["sh", "-c", release]), check=True)
        assert sorted(p.name for p in steps.iterdir()) == ["clone.lock"]
        assert not Path(locks.host_lock(layout)).exists()
        assert not Path(f"{layout.run}/md-share.pid").exists()
    finally:
        os.killpg(holding.pid, 9)  # flock and its sleep, which holds the lock too
        holding.wait()
    acquired = subprocess.run(as_user(["sh", "-c", locks.acquire_script(
        holder, lock=locks.host_lock(layout))]), capture_output=True, text=True)
    assert acquired.stdout.strip() == "acquired"
    subprocess.run(as_user(["sh", "-c", release]), check=True)
    left = [str(p.relative_to(home)) for p in sorted(home.rglob("*"))]
    assert left == [".cache", ".local", ".local/share"]  # the user's own, not meshdeploy's
    # After an apply the folders hold the services' files: they stay, only the lock goes.
    acquired = subprocess.run(as_user(["sh", "-c", locks.acquire_script(
        holder, lock=locks.host_lock(layout))]), capture_output=True, text=True)
    assert acquired.stdout.strip() == "acquired"
    subprocess.run(as_user(["mkdir", "-p", f"{layout.cache}/log/meshdeploy-rpc-50052"]),
                   check=True)
    subprocess.run(as_user(["sh", "-c", release]), check=True)
    assert Path(f"{layout.cache}/log/meshdeploy-rpc-50052").is_dir()
    assert not Path(locks.host_lock(layout)).exists()
    # A host with root: md-share stopped, then the lock: nothing else is removed there.
    root = locks.release_script(holder, layout=system_layout("/o"))
    assert root.startswith(share.stop_script(system_layout("/o"), locks.HOST_LOCK, holder.token))
    assert root.endswith(locks.release_script(holder))
