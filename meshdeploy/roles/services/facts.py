"""Facts of the services role: meshdeploy's unit files and their state."""

from __future__ import annotations

import re
from pathlib import Path

from pyinfra.api import FactBase

from meshdeploy.config.model import RUNIT, SYSTEMD_USER
from meshdeploy.core import probe, shell
from meshdeploy.roles.services import defaults as d

TEMPLATES = Path(__file__).parent / "templates"

_MODE = re.compile(r"[0-7]{1,6}")  # stat's %a / %Lp: octal digits only
_GROUP = re.compile(r"[a-z_][a-z0-9_-]{0,31}")  # a group name as useradd(8) accepts one
_LOG_MARK = "@@log"
_OWNED = " ".join(f'"$D"/{d.services_unit_prefix}{kind}*' for kind in d.services_unit_kinds)

_SHOW_MARK = "@@show"  # systemctl show's KEY=VALUE blocks follow, before the first @@unit


def _systemd_units(files: str, systemctl: str) -> str:
    """The unit files `files` (shell words) with their state: one `systemctl show` for all of
    them (three systemctl calls per unit cost a fleet's plan a second), its start time in epoch
    seconds (systemd 248 and later say "@N"; older ones' local time is turned into them by the
    host's `date`, which knows the host's time zone), then each file's mtime and text."""
    show = f"{systemctl} show -p Id -p ActiveState -p UnitFileState -p ExecMainStartTimestamp"
    return (f"u=; for f in {files}; do [ -f \"$f\" ] && u=\"$u ${{f##*/}}\"; done; "
            '[ -n "$u" ] || exit 0; '
            f"echo {_SHOW_MARK}; {show} --timestamp=unix $u 2>/dev/null || "
            f"{show} $u 2>/dev/null | while IFS= read -r l; do "
            'case "$l" in ExecMainStartTimestamp=?*) '
            'echo "ExecMainStartTimestamp=$(date -d "${l#*=}" +%s 2>/dev/null)" ;; '
            '*) printf \'%s\\n\' "$l" ;; esac; done; '
            f"for f in {files}; do "
            '[ -f "$f" ] || continue; n=${f##*/}; n=${n%.service}; '
            'echo "@@unit $n - - - $(stat -c %Y "$f")"; cat "$f"; done')

# systemd --user: the unit files of the user's unit folder "$D", read with systemctl --user.
_USER_UNITS = _systemd_units(_OWNED.replace("*", "*.service"), "systemctl --user")

# runit: each service folder "$D/<unit>" with a run script. `sv status` prints
# "run: <folder>: (pid N) Ss[; run: log: ...]" or "down: <folder>: Ss, ...".
_RUNIT_SERVICES = (f"for f in {_OWNED}; do "
                   '[ -f "$f/run" ] || continue; n=${f##*/}; '
                   's=$(sv status "$f" 2>/dev/null | head -n 1); r=${s#*"$f": }; t=-; '
                   'case "$s" in run:*) a=active; r=${r#"(pid "}; r=${r#*") "}; '
                   'r=${r%%s*}; case "$r" in ""|*[!0-9]*) ;; *) t=$(( $(date +%s) - r ));; esac ;; '
                   'down:*) a=inactive ;; fail:*) a=failed ;; *) a=unsupervised ;; esac; '
                   'if [ -e "$f/down" ]; then e=disabled; else e=enabled; fi; '
                   'echo "@@unit $n $a $e $t $(stat -c %Y "$f/run")"; cat "$f/run"; '
                   f'echo {_LOG_MARK}; cat "$f/log/run" 2>/dev/null; done')


class Units(FactBase):
    """The rpc-server and llama-server units meshdeploy put on the host (meshdeploy-rpc-*,
    meshdeploy-server-*; other roles' units are not this role's to judge).

    ```python
    {"meshdeploy-rpc-50052": {"active": "active", "enabled": "enabled", "content": "...",
                              "started": 1700000100, "written": 1700000000}}
    ```
    started: when its running process started (epoch seconds; None when not running or not
    known); written: the unit file's mtime. A unit file written after its process started was
    never applied (a run stopped between writing it and the restart).

    On a rootless host (command's `manager`): systemd --user's unit files in the user's unit
    folder, read with `systemctl --user`; or runit's service folders under $SVDIR, where content
    is the `run` script, "log" its `log/run`, active is from `sv status` (run: active, down:
    inactive, fail: failed (no runsv), unsupervised: runsvdir has not picked the folder up),
    enabled means no `down` file, and started is now minus the seconds sv reports.
    """

    def command(self, services: str | None = None, manager: str = ""):
        """+ services, manager: a rootless host's Layout.services and Layout.manager; none on a
        host with root, whose unit folders are fixed."""
        if manager == SYSTEMD_USER:
            return shell.script(_USER_UNITS, D=services)
        if manager == RUNIT:
            return shell.script(_RUNIT_SERVICES, D=services)
        # systemd hosts list unit files; macOS hosts list LaunchDaemon plists, whose running
        # state launchctl print reports.
        owned = " ".join(f"{d.services_unit_dir}/{d.services_unit_prefix}{kind}*.service"
                         for kind in d.services_unit_kinds)
        return (shell.subshell(_systemd_units(owned, "systemctl")) + "; "
                f"for f in {d.services_launchd_dir}/{d.services_launchd_prefix}*.plist; do "
                "[ -f \"$f\" ] || continue; n=${f##*/}; n=${n%.plist}; "
                "st=$(launchctl print system/$n 2>/dev/null | awk '/^\\tstate = / {print $3; exit}'); "
                "[ \"$st\" = running ] && st=active; "
                "echo \"@@unit $n ${st:-inactive} enabled\"; cat \"$f\"; done")

    def process(self, output):
        output = list(output)
        shown: dict[str, dict[str, str]] = {}
        if output and output[0] == _SHOW_MARK:
            end = next((i for i, line in enumerate(output) if line.startswith("@@unit ")),
                       len(output))
            shown, output = _show_blocks(output[1:end]), output[end:]
        units: dict[str, dict] = {}
        lines: list[str] = []
        for line in output:
            parts = line.split() if line.startswith("@@unit ") else []
            if len(parts) > 1:
                lines = []
                state = shown.get(parts[1])
                started = (probe.uint(state.get("ExecMainStartTimestamp", "").removeprefix("@"))
                           if state else _epoch(parts, 4))
                units[parts[1]] = {"active": _shown(state, "ActiveState", parts, 2),
                                   "enabled": _shown(state, "UnitFileState", parts, 3),
                                   "started": started or None, "written": _epoch(parts, 5),
                                   "lines": lines}
            elif units and line == _LOG_MARK:
                # runit: the service's log/run follows its run script.
                lines = units[list(units)[-1]]["log_lines"] = []
            elif units:
                lines.append(line)
        for unit in units.values():
            unit["content"] = "\n".join(unit.pop("lines")) + "\n"
            if "log_lines" in unit:
                unit["log"] = "\n".join(unit.pop("log_lines")) + "\n"
        return units

    @staticmethod
    def default():
        return {}


def _show_blocks(lines: list[str]) -> dict[str, dict[str, str]]:
    """systemctl show's output, KEY=VALUE lines with a blank line between units, by unit name
    (its Id less .service)."""
    shown: dict[str, dict[str, str]] = {}
    block: dict[str, str] = {}
    for line in [*lines, ""]:
        key, eq, value = line.partition("=")
        if eq:
            block[key] = value
        elif block:
            shown[block.get("Id", "").removesuffix(".service")] = block
            block = {}
    return shown


def _shown(state: dict | None, key: str, parts: list[str], index: int) -> str:
    """A unit's state from systemctl show where it ran (`state`), else the @@unit line's word
    (runit, launchd); "unknown" where neither says."""
    if state is not None:
        return state.get(key) or "unknown"
    word = parts[index] if len(parts) > index else ""
    return word if word and word != "-" else "unknown"


def _epoch(parts: list[str], index: int) -> int | None:
    value = probe.uint(parts[index]) if len(parts) > index else None
    return value or None


class Rtt(FactBase):
    """TCP connect round-trip time from this host to others, in microseconds; None for a
    target that no connect reached (a host that is down, a tunnel not up yet).

    Measured against each worker host's SSH port, never its rpc-server: rpc-server listens with
    a backlog of one and serves one client at a time, so probes there would queue behind the
    orchestrator. The cost of the measuring itself (a subshell, a refused loopback connect) is
    subtracted. A refused connect is a round trip too (the host answered); any other failure
    (no route, a timeout) is no figure at all, and the target is not tried again.

    ```python
    {"10.200.0.12:22": 180, "10.99.0.12:22": None}   # best of three; None: unreachable
    ```
    """

    def command(self, targets):
        # A host that is down must not stall the probe: each connect gets 2 s at most.
        return ("command -v bash >/dev/null && command -v timeout >/dev/null || exit 0\n"
                + shell.template(TEMPLATES / "rtt.sh", args=list(targets)))

    def process(self, output):
        out = {}
        for line in output:
            parts = line.split()
            if len(parts) == 2 and parts[1] == "-":
                out[parts[0]] = None
                continue
            micros = probe.uint(parts[1]) if len(parts) == 2 else None
            if micros is not None:
                out[parts[0]] = micros
        return out

    @staticmethod
    def default():
        return {}


class RpcClients(FactBase):
    """Who is connected to this host's rpc-servers: for each port, whether something listens on
    it and the peers of its established connections (`ss`, as the login user: no process
    names are asked for). None where the host has no `ss` (macOS, some phones).

    ```python
    {"50052": {"listening": True, "peers": ["10.200.0.11:41538"]}}   # by port, as text (JSON)
    ```
    llama-server keeps one connection to each of its rpc-servers for as long as it runs, so
    an rpc-server that listens with no client was started after its llama-server (by hand, or
    by its manager after a crash): the llama-server's next request would abort on the closed
    connection (services.llama_server restarts it instead).
    """

    def command(self, ports):
        ports = [int(p) for p in ports]
        match = " or ".join(f"sport = :{p}" for p in ports)
        return ("command -v ss >/dev/null 2>&1 || exit 0; echo ss; "
                + shell.command("ss", "-Htan", f"( {match} )") + " 2>/dev/null")

    def process(self, output):
        if not output or output[0].strip() != "ss":
            return None
        out: dict[str, dict] = {}
        for line in output[1:]:
            words = line.split()
            if len(words) < 5 or words[0] not in ("LISTEN", "ESTAB"):
                continue
            port = probe.uint(words[3].rpartition(":")[2])
            if port is None:
                continue
            entry = out.setdefault(str(port), {"listening": False, "peers": []})
            if words[0] == "LISTEN":
                entry["listening"] = True
            else:
                entry["peers"].append(words[4])
        return out

    @staticmethod
    def default():
        return None


class KeyFile(FactBase):
    """Mode and owner of a llama-server's API key file (servers.<name>.api_key_file), read as
    root where the host allows sudo (the file usually sits in a root-only folder).

    ```python
    {"exists": True, "mode": 0o600, "uid": 0, "owner": "root"}
    {"exists": False}
    {"exists": True, "mode": 0o600, "uid": 1000, "owner": "md", "reader": 1000}  # reader=True
    ```
    reader: the login user's uid, on a rootless host (the service runs as that user and reads
    the file itself). None: the host could not say (no stat, or an answer that is not mode/uid/owner).
    """

    # GNU stat first, then BSD stat (macOS).
    _BODY = ('if [ -e "$P" ]; then stat -L -c "%a %u %U" -- "$P" 2>/dev/null '
             '|| stat -L -f "%Lp %u %Su" -- "$P"; else echo missing; fi')

    def command(self, path, reader: bool = False):
        """+ reader: also print the uid of the login user reading it (rootless hosts)."""
        if reader:
            return shell.script(self._BODY + '; echo "reader $(id -u)"', P=path)
        return shell.script(self._BODY, P=path)

    def process(self, output):
        words = " ".join(output).split()
        reader = None
        if len(words) >= 2 and words[-2] == "reader":
            reader = probe.uint(words[-1])
            words = words[:-2]
            if reader is None:
                return None
        if words == ["missing"]:
            return {"exists": False} if reader is None else {"exists": False, "reader": reader}
        uid = probe.uint(words[1]) if len(words) == 3 else None
        if uid is None or not _MODE.fullmatch(words[0]):
            return None
        out = {"exists": True, "mode": int(words[0], 8), "uid": uid, "owner": words[2]}
        return out if reader is None else {**out, "reader": reader}


class RunitTools(FactBase):
    """Where a runit host's sh and svlogd are (runit hosts only): a service's `run` file is
    executed by runsv itself, so its first line must name the host's own sh (Termux has none in
    /bin), and `log/run` names svlogd.

    ```python
    {"sh": "/data/data/com.termux/files/usr/bin/sh", "svlogd": "/data/.../usr/bin/svlogd",
     "python3": "/data/.../usr/bin/python3"}   # python3: md-failover's, where a server runs
    ```
    A value is None when the tool is missing or its path is not a plain absolute path.
    """

    def command(self):
        return ('printf \'sh=%s\\nsvlogd=%s\\npython3=%s\\n\' "$(command -v sh)" '
                '"$(command -v svlogd)" "$(command -v python3)"')

    def process(self, output):
        out = {"sh": None, "svlogd": None, "python3": None}
        for line in output:
            key, sep, value = line.partition("=")
            if sep and key in out and _PLAIN_PATH.fullmatch(value):
                out[key] = value
        return out

    @staticmethod
    def default():
        return {"sh": None, "svlogd": None, "python3": None}


class Groups(FactBase):
    """Which of the groups a GPU backend's services join (services_gpu_groups) exist on the host:
    SupplementaryGroups= naming a group that does not exist stops the unit from starting
    (status=216/GROUP), and "render" only exists where udev made it.

    ```python
    ["render", "video"]
    ```
    """

    def command(self, names):
        return "getent group " + " ".join(shell.quote(n) for n in names) + " | cut -d: -f1; true"

    def process(self, output):
        # Only what a group name can be; services.unit_files keeps only the names it asked for.
        return sorted({line.strip() for line in output if _GROUP.fullmatch(line.strip())})

    @staticmethod
    def default():
        return []


class UserNamespaces(FactBase):
    """Whether the login user may make a user namespace (systemd --user hosts only): a user
    manager builds a unit's file-system sandbox (ProtectHome=, ProtectSystem=, PrivateTmp=, ...)
    only inside one of its own (PrivateUsers=yes), ignores those settings silently without
    PrivateUsers=, and fails to start the unit where the kernel refuses the namespace.

    ```python
    True    # `unshare --user true` succeeded as the login user
    False   # refused (kernel.unprivileged_userns_clone=0, user.max_user_namespaces=0, an LSM), or no unshare
    ```
    """

    def command(self):
        return ('if command -v unshare >/dev/null 2>&1 && unshare --user true 2>/dev/null; '
                'then echo userns=yes; else echo userns=no; fi')

    def process(self, output):
        return any(line.strip() == "userns=yes" for line in output)

    @staticmethod
    def default():
        return False


# A path a `#!` line or an unquoted word can carry as it is.
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9_./+-]*")
