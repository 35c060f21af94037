"""What md-failover (templates/md-failover.py) says on a host: where its state file is, and the
`meshdeploy status` row of each server it runs ("without node3 since 14:02")."""

from __future__ import annotations

import json

from meshdeploy.core import shell
from meshdeploy.core.registry import StatusProbe, StatusRow
from meshdeploy.core.units import unit_name

FILE = "failover.json"


def folder(host, server) -> str:
    """md-failover's folder on `host`: its state file and the Unix socket llama-server listens
    on behind it. A system unit's RuntimeDirectory (named after the unit); on a rootless host a
    folder of the same name in the user's cache, which the llama_server step makes (0700): never
    under $XDG_RUNTIME_DIR, which a systemd --user unit's sandbox hides whole
    (InaccessiblePaths=%t: the user's systemd and D-Bus sockets are there)."""
    if host.layout.rootless:
        return f"{host.layout.cache}/{server.unit_name}"
    return f"/run/{server.unit_name}"


def remove_folder(host, unit: str) -> list[str]:
    """Commands that remove md-failover's folder of the llama-server unit `unit` with it (a
    name the Units fact reported, checked first: no "/" can reach elsewhere). On a rootless
    host only: a system unit's RuntimeDirectory goes with the unit."""
    if not host.layout.rootless:
        return []
    return [shell.command("rm", "-rf", "--",
                          f"{host.layout.cache}/{unit_name(unit, 'service name')}")]


def state_path(host, server) -> str:
    """Where md-failover writes its state on `host` (folder()). Under launchd (macOS has no
    /run) it writes none."""
    return f"{folder(host, server)}/{FILE}"


# `failover NAME STATE-JSON` per server: the file is small (md-failover writes one line).
_SCRIPT = ('while [ $# -gt 1 ]; do printf \'failover %s %s\\n\' "$1" '
           '"$(head -c 4096 "$2" 2>/dev/null | tr -d \'\\n\')"; shift 2; done')


def status(cluster, host, supervised) -> StatusProbe | None:
    """Rows of the servers md-failover runs on `host` (supervised: their names): which
    placement runs and since when; not healthy while a worker is away (status then says
    degraded) or while no placement can run (the server's own row says it does not answer)."""
    servers = [s for s in cluster.servers if s.host == host.name and s.name in supervised]
    paths = {s.name: state_path(host, s) for s in servers}
    args = [w for name, path in paths.items() for w in (name, path)]
    if not args:
        return None

    def parse(lines: list[str]) -> list[StatusRow]:
        rows, seen = [], set()
        for line in lines:
            word, _, rest = line.partition(" ")
            name, _, text = rest.partition(" ")
            if word != "failover" or name not in paths or name in seen:
                continue
            seen.add(name)
            rows.append(_row(name, text))
        return rows + [StatusRow(f"failover {n}", "unknown", "no status line", False)
                       for n in sorted(set(paths) - seen)]

    return StatusProbe(shell.script(_SCRIPT, args=args), parse)


def _row(name: str, text: str) -> StatusRow:
    try:
        state = json.loads(text) if text else None
    except ValueError:
        state = None
    if state is None and not text:
        # Starting, stopped (the server's own row says whether it answers), or under launchd,
        # where md-failover keeps no state file.
        return StatusRow(f"failover {name}", "unknown", "no state file", True)
    if not isinstance(state, dict) or not isinstance(state.get("lost"), list):
        return StatusRow(f"failover {name}", "unknown", "state file unreadable", False)
    lost = [str(x) for x in state["lost"]]
    since = str(state.get("since") or "?")
    what = str(state.get("state") or "?")
    away = ", ".join(lost)
    if what == "serving" and not lost:
        return StatusRow(f"failover {name}", what, f"full placement since {since}", True)
    if what == "serving":
        return StatusRow(f"failover {name}", what,
                         f"without {away} since {since} (--rpc {state.get('rpc') or 'none'})",
                         False)
    if what == "down":
        return StatusRow(f"failover {name}", what,
                         f"down while {away} {'is' if len(lost) == 1 else 'are'} away "
                         f"(since {since}): no placement without them", False)
    return StatusRow(f"failover {name}", what, f"{what} since {since}", False)
