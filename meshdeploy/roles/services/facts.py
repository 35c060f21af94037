"""Facts of the services role: meshdeploy's unit files and their state."""

from __future__ import annotations

import re

from pyinfra.api import FactBase

from meshdeploy.core import probe, shell
from meshdeploy.roles.services import defaults as d

_MODE = re.compile(r"[0-7]{1,6}")  # stat's %a / %Lp: octal digits only


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
    """

    def command(self):
        # systemd hosts list unit files; macOS hosts list LaunchDaemon plists, whose running
        # state launchctl print reports.
        owned = " ".join(f"{d.services_unit_dir}/{d.services_unit_prefix}{kind}*.service"
                         for kind in d.services_unit_kinds)
        return (f"for f in {owned}; do "
                "[ -f \"$f\" ] || continue; n=${f##*/}; n=${n%.service}; "
                "t=$(systemctl show -p ExecMainStartTimestamp --value $n 2>/dev/null); "
                "t=$( [ -n \"$t\" ] && date -d \"$t\" +%s 2>/dev/null || echo -); "
                "echo \"@@unit $n $(systemctl is-active $n 2>/dev/null) "
                "$(systemctl is-enabled $n 2>/dev/null) $t $(stat -c %Y \"$f\")\"; "
                "cat \"$f\"; done; "
                f"for f in {d.services_launchd_dir}/{d.services_launchd_prefix}*.plist; do "
                "[ -f \"$f\" ] || continue; n=${f##*/}; n=${n%.plist}; "
                "st=$(launchctl print system/$n 2>/dev/null | awk '/^\\tstate = / {print $3; exit}'); "
                "[ \"$st\" = running ] && st=active; "
                "echo \"@@unit $n ${st:-inactive} enabled\"; cat \"$f\"; done")

    def process(self, output):
        units: dict[str, dict] = {}
        lines: list[str] = []
        for line in output:
            parts = line.split() if line.startswith("@@unit ") else []
            if len(parts) > 1:
                lines = []
                units[parts[1]] = {"active": parts[2] if len(parts) > 2 else "unknown",
                                   "enabled": parts[3] if len(parts) > 3 else "unknown",
                                   "started": _epoch(parts, 4), "written": _epoch(parts, 5),
                                   "lines": lines}
            elif units:
                lines.append(line)
        for unit in units.values():
            unit["content"] = "\n".join(unit.pop("lines")) + "\n"
        return units

    @staticmethod
    def default():
        return {}


def _epoch(parts: list[str], index: int) -> int | None:
    value = probe.uint(parts[index]) if len(parts) > index else None
    return value or None


class Rtt(FactBase):
    """TCP connect round-trip time from this host to others, in microseconds.

    Measured against each worker host's SSH port, never its rpc-server: rpc-server listens with
    a backlog of one and serves one client at a time, so probes there would queue behind the
    orchestrator. The cost of the measuring itself (a subshell, a refused loopback connect) is
    subtracted.

    ```python
    {"10.200.0.12:22": 180, ...}   # best of three
    ```
    """

    # "$@": the "address:port" targets, as arguments of a fixed bash script.
    _BODY = ('ms(){ s=$(date +%s%N); timeout 2 bash -c \'exec 3<>"/dev/tcp/$1/$2"\' rtt "$1" "$2" '
             '2>/dev/null; e=$(date +%s%N); echo $(( (e-s)/1000 )); }; '
             'best(){ b=99999999; for i in 1 2 3; do t=$(ms "$1" "$2"); [ "$t" -lt "$b" ] && b=$t; '
             'done; echo "$b"; }; base=$(best 127.0.0.1 1); '
             'for ep in "$@"; do t=$(best "${ep%:*}" "${ep##*:}"); '
             'echo "$ep $(( t > base ? t - base : 0 ))"; done')

    def command(self, targets):
        # A host that is down must not stall the probe: each connect gets 2 s at most.
        return ("command -v bash >/dev/null && command -v timeout >/dev/null || exit 0; "
                + shell.command("bash", "-c", self._BODY, "rtt", *targets))

    def process(self, output):
        out = {}
        for line in output:
            parts = line.split()
            micros = probe.uint(parts[1]) if len(parts) == 2 else None
            if micros is not None:
                out[parts[0]] = micros
        return out

    @staticmethod
    def default():
        return {}


class KeyFile(FactBase):
    """Mode and owner of a llama-server's API key file (servers.<name>.api_key_file), read as
    root where the host allows sudo (the file usually sits in a root-only folder).

    ```python
    {"exists": True, "mode": 0o600, "uid": 0, "owner": "root"}
    {"exists": False}
    ```
    None: the host could not say (no stat, or an answer that is not mode/uid/owner).
    """

    # GNU stat first, then BSD stat (macOS).
    _BODY = ('if [ -e "$P" ]; then stat -L -c "%a %u %U" -- "$P" 2>/dev/null '
             '|| stat -L -f "%Lp %u %Su" -- "$P"; else echo missing; fi')

    def command(self, path):
        return shell.script(self._BODY, P=path)

    def process(self, output):
        words = " ".join(output).split()
        if words == ["missing"]:
            return {"exists": False}
        uid = probe.uint(words[1]) if len(words) == 3 else None
        if uid is None or not _MODE.fullmatch(words[0]):
            return None
        return {"exists": True, "mode": int(words[0], 8), "uid": uid, "owner": words[2]}
