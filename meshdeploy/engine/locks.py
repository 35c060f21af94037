"""Locks: one apply (or destroy) of a cluster at a time.

Two places, because two operators may run from two machines:
- on the control machine, `<stem>.state.lock` beside the state file, held with flock(2) for the
  whole run; the kernel drops it when the process dies, so it is never stale. The file keeps the
  holder (pid, machine, user, since) for the message a second run prints;
- on every host, the folder apply.lock in the host's run folder (Layout.run: /run/meshdeploy on a
  host with root, taken through sudo; on a rootless host the login user's
  $XDG_RUNTIME_DIR/meshdeploy, or a folder under its cache, taken as that user) with an `owner`
  line; mkdir is atomic. A run refreshes its mtime every HEARTBEAT seconds while it
  holds it. Another run takes a host lock over only when it is stale: its holder is a process
  of this same machine that no longer exists, or its heartbeat stopped more than STALE seconds
  ago (a run killed on another machine). That is all a remote check can know: a holder whose
  machine is merely paused or cut off for longer than STALE counts as dead. A lock a reboot
  left (a run folder outside /run survives one) is stale by the same rule.
`-lock-timeout=DURATION` waits for a held lock instead of failing at once.
"""

from __future__ import annotations

import errno
import fcntl
import getpass
import json
import os
import re
import secrets
import socket
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from meshdeploy.config.model import Layout
from meshdeploy.core import inflight, share, shell
from meshdeploy.core.plan import utc_now
from meshdeploy.errors import LOCKED, MeshdeployError, PlanError

HOST_DIR = "/run/meshdeploy"
HOST_LOCK = f"{HOST_DIR}/apply.lock"
HEARTBEAT = 15  # seconds between refreshes of a held host lock
STALE = 90  # seconds without a refresh after which a host lock's holder counts as dead
SUFFIX = ".state.lock"


class LockedError(MeshdeployError):
    exit_code = LOCKED


def host_lock(layout: Layout | None = None) -> str:
    """The host lock's folder on a host with `layout` (None: a host with root)."""
    return HOST_LOCK if layout is None or not layout.rootless else f"{layout.run}/apply.lock"


def lock_path(cluster_path: Path) -> Path:
    return Path(cluster_path).with_name(Path(cluster_path).stem + SUFFIX)


def duration(text: str) -> float:
    """-lock-timeout's value: "0", "30s", "5m", "1h" (a bare number is seconds)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if not match:
        raise PlanError(f"-lock-timeout={text}: not a duration", hint="write e.g. 30s, 5m or 0")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


@dataclass(frozen=True)
class Holder:
    pid: int
    machine: str
    user: str
    since: str
    command: str
    token: str = ""

    def describe(self) -> str:
        return (f"meshdeploy {self.command} of {self.user}@{self.machine} (pid {self.pid}), "
                f"since {self.since}")

    def dead_here(self) -> bool:
        """A process of this machine that no longer exists (another machine's: unknown)."""
        if self.machine != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(**{k: data[k] for k in ("pid", "machine", "user", "since", "command")},
                       token=str(data.get("token", "")))
        except (ValueError, KeyError, TypeError):
            return None


def me(command: str) -> Holder:
    try:
        user = getpass.getuser()
    except Exception:  # no name for the uid (containers)
        user = str(os.getuid())
    return Holder(os.getpid(), socket.gethostname(), user, utc_now(), command,
                  secrets.token_hex(8))


class ControlLock:
    """flock on `<stem>.state.lock`; with `with`, released on exit."""

    def __init__(self, cluster_path: Path, holder: Holder, timeout: float = 0.0):
        self.path = lock_path(cluster_path)
        self.holder = holder
        self.timeout = timeout
        self.fd: int | None = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()

    def acquire(self) -> None:
        fd = self._open()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
                    os.close(fd)
                    who = holder.describe() if holder else "another meshdeploy run"
                    raise LockedError(f"{self.path}: the cluster is locked by {who}",
                                      hint="wait for it to finish, or wait with "
                                           "-lock-timeout=5m") from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(asdict(self.holder)).encode() + b"\n", 0)
        self.fd = fd

    def _open(self) -> int:
        """The lock file, never through a link planted at its name: it is truncated and
        written, so a link (or a second name of another file) would have that file emptied.
        O_NONBLOCK: a FIFO planted there fails the check instead of blocking the open."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o644)
        except OSError as e:
            why = "a symbolic link, not a regular file" if e.errno == errno.ELOOP else e.strerror
            raise MeshdeployError(f"{self.path}: cannot open the cluster's lock file: {why}",
                                  hint=f"remove {self.path} (meshdeploy makes it again)") from None
        st = os.fstat(fd)
        problem = ("not a regular file" if not stat.S_ISREG(st.st_mode)
                   else "the file has more than one name (a hard link)" if st.st_nlink != 1
                   else None)
        if problem:
            os.close(fd)
            raise MeshdeployError(f"{self.path}: refusing the cluster's lock file: {problem}",
                                  hint=f"remove {self.path} (meshdeploy makes it again)")
        return fd

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


_REFRESH = r'grep -qF "$TOKEN" "$LOCK/owner" 2>/dev/null && touch "$LOCK/owner"'
# Moved aside first, like a taken-over lock: never a lock folder without its owner line.
_RELEASE = (r'if grep -qF "$TOKEN" "$LOCK/owner" 2>/dev/null; then '
            r'mv "$LOCK" "$LOCK.gone.$TOKEN" && rm -rf "$LOCK.gone.$TOKEN"; fi; true')


def acquire_script(holder: Holder, take: str = "", lock: str = HOST_LOCK) -> str:
    # templates/lock-acquire.sh: how several runs take one stale lock over at once.
    return shell.template(shell.TEMPLATES / "lock-acquire.sh", DIR=lock.rsplit("/", 1)[0],
                          LOCK=lock, OWNER=json.dumps(asdict(holder)), TAKE=take,
                          TOKEN=holder.token)


def refresh_script(holder: Holder, lock: str = HOST_LOCK) -> str:
    return shell.script(_REFRESH, LOCK=lock, TOKEN=holder.token)


def release_script(holder: Holder, lock: str = HOST_LOCK, layout: Layout | None = None) -> str:
    """The lock removed when this run holds it, md-share stopped first (it serves during a run
    only); on a rootless host also the files finished steps leave in the run folder, and
    meshdeploy's own folders of the layout that are left empty (after destroy --purge: nothing
    of meshdeploy's stays in the user's folders). rmdir removes only empty folders, so after an
    apply the folders that hold something stay."""
    # md-share first, while the lock is still this run's (core.share.stop_script).
    stop = share.stop_script(layout, lock, holder.token) + "\n" if layout is not None else ""
    if layout is None or not layout.rootless:
        return stop + shell.script(_RELEASE, LOCK=lock, TOKEN=holder.token)
    # Step files and md-share's pid file in the run folder first (see the template), then the
    # lock, then the folders left empty.
    return stop + shell.template(shell.TEMPLATES / "rootless-tidy.sh", args=tidy_folders(layout),
                                 STEPS=inflight.steps_dir(layout),
                                 PID=f"{layout.run}/md-share.pid", LOCK=lock, TOKEN=holder.token)


def tidy_folders(layout: Layout) -> list[str]:
    """A rootless layout's folders that meshdeploy makes, children before their parents (its
    services folder is the user's own, or termux-services', and stays)."""
    folders = [f"{layout.run}/steps", layout.run, f"{layout.cache}/log", layout.cache,
               layout.prefix]
    return sorted(set(folders), key=lambda f: (-f.count("/"), folders.index(f)))


@dataclass(frozen=True)
class Answer:
    """What a host said to an acquire: acquired, or held by `owner` (its raw line) whose
    heartbeat is `age` seconds old."""

    acquired: bool
    age: int = 0
    owner: str = ""

    @property
    def holder(self) -> Holder | None:
        return Holder.parse(self.owner)

    def stale(self) -> bool:
        holder = self.holder
        return holder is None and self.age > STALE or holder is not None and (
            holder.dead_here() or self.age > STALE)


def parse_answer(lines) -> Answer | None:
    for line in lines:
        if line.strip() == "acquired":
            return Answer(True)
        if line.startswith("held "):
            _, age, *rest = line.split(" ", 2) + [""]
            return Answer(False, int(age) if age.lstrip("-").isdigit() else 0,
                          rest[0].strip() if rest else "")
    return None


class HostLocks:
    """The lock on every host of a session, refreshed while held; released on exit."""

    def __init__(self, session, holder: Holder, timeout: float = 0.0, notes=print):
        self.session = session
        self.holder = holder
        self.timeout = timeout
        self.notes = notes
        self.held: list[str] = []
        self.layouts: dict[str, Layout | None] = {}  # host name -> its layout
        self._beat = None

    def __enter__(self):
        try:
            for h in self.session.reached():
                self.layouts[h.name] = h.layout
                self._acquire(h.name)
        except BaseException:
            self.release()
            raise
        import gevent

        self._beat = gevent.spawn(self._heartbeat)
        return self

    def __exit__(self, *exc):
        self.release()

    def lock(self, name: str) -> str:
        """The lock's folder on host `name`."""
        return host_lock(self.layouts.get(name))

    def _rootless(self, name: str) -> bool:
        layout = self.layouts.get(name)
        return layout is not None and layout.rootless

    def _run(self, name: str, script: str) -> list[str]:
        ok, output = self.session.run(name, script)
        if not ok:
            lock = self.lock(name)
            raise PlanError(f"{name}: cannot take the lock {lock}: "
                            + " ".join(getattr(output, "stderr_lines", [])[-3:]),
                            hint=f"the login user of {name} must be able to make "
                                 f"{lock.rsplit('/', 1)[0]} (its run folder, in "
                                 "$XDG_RUNTIME_DIR or else under its cache folder); check "
                                 "that nothing there belongs to another user"
                            if self._rootless(name) else
                            "meshdeploy needs root (ssh.sudo) to lock a host under /run")
        return list(output.stdout_lines)

    def _acquire(self, name: str) -> None:
        deadline = time.monotonic() + self.timeout
        take = ""
        lock = self.lock(name)
        while True:
            answer = parse_answer(self._run(name, acquire_script(self.holder, take, lock)))
            if answer is None:
                raise PlanError(f"{name}: no answer from the lock script",
                                hint="run it again; report it if it persists")
            if answer.acquired:
                self.held.append(name)
                if take:
                    self.notes(f"{name}: took over a stale lock "
                               f"({_who(Holder.parse(take), take)})")
                    self._stop_orphans(name)
                return
            # Stale: ask again, taking it over. The same stale lock after that ask means another
            # run is taking it over right now: wait as for a held lock (asking at once would spin).
            if answer.stale() and answer.owner != take:
                take = answer.owner
                continue
            if time.monotonic() >= deadline:
                taking = answer.stale()
                raise LockedError(f"{name}: the cluster is locked by "
                                  f"{_who(answer.holder, answer.owner)} "
                                  f"(last heartbeat {answer.age} s ago"
                                  + (", stale: another run is taking it over)" if taking
                                     else ")"),
                                  hint=f"wait for it to finish, or wait with -lock-timeout=5m; "
                                       f"a run killed on another machine counts as stale "
                                       f"{STALE} s after its last heartbeat"
                                       + (f"; if this persists, the run taking it over died: "
                                          f"remove {lock} on {name}" if taking else ""))
            time.sleep(2)

    def _stop_orphans(self, name: str) -> None:
        """A dead run's download, build or seeding may still run on the host (no terminal, no
        SIGHUP): end it before this run plans, so nothing writes beside this run's steps."""
        stop = inflight.stop_script(layout=self.layouts.get(name))
        for step in inflight.parse_stopped(self._run(name, stop)):
            self.notes(f"{name}: stopped {step}, left running by that run")

    def _heartbeat(self) -> None:
        import gevent

        while True:
            gevent.sleep(HEARTBEAT)
            for name in list(self.held):
                try:
                    self.session.run(name, refresh_script(self.holder, self.lock(name)))
                except Exception:  # a failed refresh shows up as a stale lock, never a crash
                    pass

    def release(self) -> None:
        if self._beat is not None:
            self._beat.kill()
            self._beat = None
        for name in self.held:
            try:
                self.session.run(name, release_script(self.holder, self.lock(name),
                                                      self.layouts.get(name)))
            except Exception:  # an unreachable host keeps a lock that goes stale
                pass
        self.held = []


def _who(holder: Holder | None, raw: str) -> str:
    return holder.describe() if holder else (raw.strip() or "an unknown holder")
