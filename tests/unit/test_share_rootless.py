"""md-share on a rootless host (issue 22): started by core.share as the login user, run for real
here as a user without root (nobody, through setpriv) on loopback.

Under runit it is a process of the user's in a session of its own, its pid file and log in the
user's folders, stopped and replaced through the pid file; under systemd --user it is a
transient unit of the user's manager (`systemd-run --user`, checked through stand-ins that
record their arguments and start the command, as test_share_start does for the system's).
Nothing of it names sudo, setpriv, nobody or the system's manager.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from support.require import needs
from test_md_share import free_port
from test_share_start import FAKE_CTL, FAKE_RUN, HOST_PATH, get, running, uid_of

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.model import RUNIT, SYSTEMD_USER, Layout
from meshdeploy.core import account, share, transient
from meshdeploy.core.paths import model_share_port

NOBODY = pwd.getpwnam("nobody")
AS_USER = os.geteuid() == 0 and shutil.which("setpriv") and Path("/proc/self/status").exists() \
    and shutil.which("python3", path=HOST_PATH)
needs_user = pytest.mark.skipif(not AS_USER, reason="runs md-share as a user without root: "
                                                    "needs root (to become nobody) and setpriv")


def layout_in(home: Path, manager: str) -> Layout:
    return Layout(prefix=f"{home}/.local/share/meshdeploy", cache=f"{home}/.cache/meshdeploy",
                  run=f"{home}/.cache/meshdeploy/run", services=f"{home}/sv", manager=manager,
                  home=str(home))


@pytest.fixture
def home():
    """A home folder the user (nobody) owns, holding md-share and a model file of its own."""
    d = Path(tempfile.mkdtemp(prefix="md-share-rootless-", dir="/tmp"))
    d.chmod(0o755)
    tools = d / ".local" / "share" / "meshdeploy" / "tools"
    tools.mkdir(parents=True)
    shutil.copy(share.SERVER, tools / share.NAME)
    (d / "blob").write_bytes(os.urandom(4096))
    (d / "blob").chmod(0o600)  # the user's own file: nobody else needs to read it
    for path in [d, *d.rglob("*")]:
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    yield d
    for pid_file in d.rglob("md-share.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
    time.sleep(0.3)
    shutil.rmtree(d, ignore_errors=True)


def script(home: Path, port: int, manager: str, idle: int = 30) -> str:
    layout = layout_in(home, manager)
    args = ["--bind", "127.0.0.1", "--port", port, "--allow", "127.0.0.1",
            "--file", f"blob={home / 'blob'}", "--idle", idle, "--max", 60]
    return share.start_script(share.server_path(layout.prefix), args, "phone", ["127.0.0.1"],
                              manager, **share.paths(layout))


def as_user(text: str, **env: str) -> subprocess.CompletedProcess:
    """`text` run by sh as nobody, with no privilege left (what an SSH login without root is)."""
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups",
         "--no-new-privs", "sh", "-c", text], capture_output=True, text=True, timeout=30,
        env={"PATH": HOST_PATH, "HOME": "/nonexistent", **env}, cwd="/")


def test_a_rootless_hosts_scripts_name_no_root_and_no_system_manager(tmp_path):
    home = Path("/home/md")
    runit, user = script(home, 1, RUNIT), script(home, 1, SYSTEMD_USER)
    for text in (runit, user):
        for word in ("sudo", "setpriv", "nobody", "chown", "/var/", "/run/meshdeploy",
                     transient.BOOTED, "DynamicUser", "IPAddress"):
            assert word not in text, word
    assert "systemd" not in runit and "systemctl" not in runit
    # Under systemd --user: one systemd-run (md_systemd_run's), reached with --user only, and
    # systemctl/journalctl pointed at the user's manager before anything calls them.
    called = user.replace("md-share did not start (systemd-run)", "")  # the message's
    assert called.count("systemd-run") == 1 and 'systemd-run "$@"' in called
    assert "md_share_unit() { md_systemd_run --user --quiet --collect" in user
    assert user.index("systemctl() { command systemctl --user") < user.index("md_unit_free \"$UNIT")
    layout = layout_in(home, RUNIT)
    assert f"PID={layout.run}/md-share.pid\n" in runit
    assert f"LOG={layout.cache}/md-share.log\n" in runit


def test_start_puts_md_share_in_the_users_prefix(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cluster: t\nllama_cpp: {ref: b1}\nnetwork: {firewall: false}\n"
                    "hosts:\n  phone: {address: 10.0.0.2, rootless: true}\n"
                    "  node: {address: 10.0.0.3}\nmodels: {}\n")
    layout = layout_in(Path("/data/home"), RUNIT)
    cluster = account.resolved(load_cluster(path), {"phone": layout})
    write, start = share.start(cluster, cluster.host("phone"), {"ab" * 32: "/data/home/m.gguf"},
                               [cluster.host("node")])
    assert write.startswith(f"mkdir -p {layout.prefix}/tools && cat > "
                            f"{layout.prefix}/tools/md-share.py.meshdeploy-tmp")
    assert f"SERVER={layout.prefix}/tools/md-share.py\n" in start
    assert "--bind 10.0.0.2 --port 29180" in start and "--allow 10.0.0.3" in start


@needs_user
def test_under_runit_it_runs_as_the_user_and_is_replaced_through_its_pid_file(home):
    layout = layout_in(home, RUNIT)
    pid_file, log = Path(layout.run) / "md-share.pid", Path(layout.cache) / "md-share.log"
    # A stale pid file (a reboot) that names another process of the user: it must live.
    bystander = subprocess.Popen(["setpriv", f"--reuid={NOBODY.pw_uid}",
                                  f"--regid={NOBODY.pw_gid}", "--clear-groups", "sleep", "60"])
    try:
        pid_file.parent.mkdir(parents=True)
        pid_file.write_text(f"{bystander.pid}\n")
        for path in (pid_file.parent.parent, pid_file.parent, pid_file):
            os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
        port = free_port()
        done = as_user(script(home, port, RUNIT))
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"md-share serving on port {model_share_port}\n"
        assert bystander.poll() is None
        first = int(pid_file.read_text())
        assert uid_of(first) == NOBODY.pw_uid
        assert (pid_file.parent.stat().st_mode & 0o777) == 0o700
        assert (log.parent.stat().st_mode & 0o777) == 0o700
        assert get(port) == (home / "blob").read_bytes()[:10]
        assert "listening 127.0.0.1" in log.read_text()

        # A later start stops the earlier one (its pid file is genuine) and takes its place.
        done = as_user(script(home, port, RUNIT))
        assert done.returncode == 0, done.stderr
        second = int(pid_file.read_text())
        assert second != first and not running(first)
        assert get(port) == (home / "blob").read_bytes()[:10]
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


@needs_user
def test_under_runit_it_still_exits_once_idle(home):
    layout = layout_in(home, RUNIT)
    pid_file = Path(layout.run) / "md-share.pid"
    port = free_port()
    done = as_user(script(home, port, RUNIT, idle=1))
    assert done.returncode == 0, done.stderr
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(pid) and not pid_file.exists()


@needs_user
def test_under_runit_a_failed_start_says_why(home):
    import socket

    busy = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", busy))
        s.listen()
        done = as_user(script(home, busy, RUNIT))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("phone: md-share did not start:\n"), done.stderr
    assert f"cannot listen on 127.0.0.1 port {busy}" in done.stderr


# Stand-ins for the user's manager: test_share_start's systemd-run (it records its arguments and
# starts the command), and its systemctl behind one that answers only when asked with --user.
USER_CTL = r"""#!/bin/sh
echo "$*" >> "$FAKE/user.calls"
[ "$1" = --user ] || exit 1
shift
exec "${0%/*}/systemctl-of-the-manager" "$@"
"""


@needs_user
def test_under_systemd_user_it_is_a_unit_of_the_users_manager(home):
    fake = home / "fake"
    (fake / "bin").mkdir(parents=True)
    for name, text in (("systemd-run", FAKE_RUN), ("systemctl", USER_CTL),
                       ("systemctl-of-the-manager", FAKE_CTL)):
        (fake / "bin" / name).write_text(text)
        (fake / "bin" / name).chmod(0o755)
    for path in [fake, *fake.rglob("*")]:
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    layout = layout_in(home, SYSTEMD_USER)
    pid_file = Path(layout.run) / "md-share.pid"
    port = free_port()
    env = {"PATH": f"{fake / 'bin'}:{HOST_PATH}", "FAKE": str(fake)}
    try:
        done = as_user(script(home, port, SYSTEMD_USER), **env)
        assert done.returncode == 0, done.stderr
        assert get(port) == (home / "blob").read_bytes()[:10]
        assert uid_of(int(pid_file.read_text())) == NOBODY.pw_uid
    finally:
        as_user("systemctl --user stop meshdeploy-share.service", **env)
    calls = (fake / "user.calls").read_text().splitlines()
    assert calls[0] == "--user stop meshdeploy-share.service"  # an earlier one goes first
    assert all(c.startswith("--user ") for c in calls)
    argv = (fake / "run.args").read_text().splitlines()
    assert argv[0] == "--user" and "--unit=meshdeploy-share" in argv and "--collect" in argv
    props = [argv[i + 1] for i, a in enumerate(argv) if a == "-p"]
    assert props == share.user_properties(f"{layout.cache}/md-share.log")
    command = argv[argv.index("--") + 1:]
    assert command[1:4] == [share.server_path(layout.prefix), "--pid-file", str(pid_file)]


@pytest.mark.skipif(not AS_USER, reason="systemd-analyze run as a user: needs root and setpriv")
@needs("systemd-analyze")
def test_the_user_units_settings_are_valid_for_a_user_manager(home):
    """systemd-analyze verify --user reads the settings as a user manager would (an option a
    user manager does not know, or a typo, fails it)."""
    unit = home / "meshdeploy-share.service"
    unit.write_text("[Service]\nExecStart=/usr/bin/python3 /x/md-share.py\n" + "".join(
        f"{p}\n" for p in share.user_properties(str(home / "md-share.log"))))
    os.chown(unit, NOBODY.pw_uid, NOBODY.pw_gid)
    done = as_user(f"systemd-analyze verify --user {unit}", XDG_RUNTIME_DIR=str(home),
                   HOME=str(home))
    assert done.returncode == 0, done.stdout + done.stderr
    assert not [p for p in share.user_properties("/l") if p.split("=")[0] in
                ("DynamicUser", "RuntimeDirectory", "IPAddressAllow", "ProtectSystem",
                 "PrivateTmp", "CapabilityBoundingSet")]


@needs_user
def test_the_runs_lock_release_stops_md_share_and_a_taken_over_lock_leaves_it(home):
    """md-share lives for one run: the release of the host lock stops it, and only while that
    lock is still the run's (a run that took a stale lock over keeps its own md-share)."""
    from meshdeploy.engine import locks

    layout = layout_in(home, RUNIT)
    pid_file = Path(layout.run) / "md-share.pid"
    lock = locks.host_lock(layout)
    mine, theirs = locks.me("apply"), locks.me("apply")
    for holder, stays in ((theirs, True), (mine, False)):
        port = free_port()
        done = as_user(script(home, port, RUNIT))
        assert done.returncode == 0, done.stderr
        pid = int(pid_file.read_text())
        taken = as_user(locks.acquire_script(holder, lock=lock))
        assert taken.stdout.strip() == "acquired", taken.stderr
        released = as_user(locks.release_script(mine, lock, layout))
        assert released.returncode == 0, released.stderr
        if stays:  # their lock: md-share serves on, and the lock is still theirs
            assert running(pid) and get(port) == (home / "blob").read_bytes()[:10]
            assert holder.token in Path(lock, "owner").read_text()
            assert as_user(locks.release_script(theirs, lock, layout)).returncode == 0
        deadline = time.monotonic() + 5  # the release that holds the lock stops it
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(pid) and not pid_file.exists()
        assert not Path(lock).exists()
