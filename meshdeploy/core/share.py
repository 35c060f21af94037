"""md-share: a host's verified model files served to the cluster's other hosts during an apply.

One internet download per model: the host of a model's first llama-server downloads it
(models.gguf), and the other hosts get their bytes from that copy over the LAN, never from the
internet again. Two roles start md-share (templates/md-share.py, Python's standard library) on
that host, each with what its step needs:

- models.gguf, while a host that keeps a whole GGUF copies it: the file, served from its
  partial as it arrives (`--growing`), so the copy trails the download;
- rpc_cache.share, while a worker misses tensors: the verified file, for ranged GETs;
- llama_cpp.copy, on the host that compiled a build other hosts of its build key copy: the
  build's tarball and its sha256 (lan_url; roles/llama_cpp/keys.py).

A later start replaces an earlier one; md-share answers loopback and the hosts named, on the
host's cluster address (its tunnel address under WireGuard). It lives for one run: the run
stops it as it releases the host's lock (stop_script), and were that release lost (the control
machine died), it exits by itself once idle.
network.allowlist opens its port to the same hosts alone. Under network.transport: ssh it binds
loopback only: each receiving host is a worker of the source, and the source's forward to it
carries a reverse end (`-R`, reverse_port) from the worker's loopback back to md-share, so no
model byte crosses the hosts' network in clear and no port opens.

md-share never runs as root. Where systemd is PID 1 (the lab's Debian 12, systemd 252) it is a
transient unit, `systemd-run --unit=meshdeploy-share --collect` with a dynamic user and the
sandbox of HARDENING (pinned by tests/unit/test_unit_hardening.py): systemd owns its lifecycle, and
`systemctl stop` ends an earlier one. Elsewhere (macOS, a Linux without systemd) it runs as
`nobody`, through setpriv where util-linux has it, else sudo -u. Either way it reads the files as
any user may (the models role leaves 0644 files under 0755 folders; the llama-servers' own
DynamicUser units read them too), and its lines go to LOG, opened for it by root (systemd's
StandardOutput=append:, the shell's >>).

On a rootless host it runs as the login user, who owns the files it serves, with its pid file
and log in the user's folders (paths(): Layout.run, Layout.cache). Under systemd --user it is
a transient unit of the user's manager, `systemd-run --user`, with what such a manager enforces
(USER_HARDENING; no DynamicUser, and no IPAddressAllow: md-share's own allow-list is the filter
there). Under runit, which supervises services and starts nothing for a step, it is a
background process of the user's in a session of its own, stopped and replaced through its pid
file as on a host without systemd. Either way it still exits by itself once idle.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from meshdeploy.config import distribution
from meshdeploy.config.model import RUNIT, SYSTEMD_USER
from meshdeploy.core import shell, transient
from meshdeploy.core.paths import model_share_port
from meshdeploy.errors import PlanError

SERVER = Path(__file__).with_name("templates") / "md-share.py"
NAME = "md-share.py"  # under llama_cpp.prefix/tools
PYTHON = "python3"
LOOPBACK = "127.0.0.1"
IDLE = 300  # seconds without a request before md-share exits
MAX = 6 * 3600  # and at the latest this long after it started
WAIT = 120  # seconds a growing file may stall before a reply is cut short
UNIT = "meshdeploy-share"
# Where md-share writes its pid file once it listens: the unit's RuntimeDirectory= under systemd
# (/var/run is /run there), a folder root makes for nobody elsewhere (macOS has no /run).
PID = f"/var/run/{UNIT}/md-share.pid"
OLD_PID = "/run/meshdeploy/md-share.pid"  # a root md-share's, before it ran unprivileged
LOG = "/var/log/meshdeploy-share.log"

# The transient unit's settings (systemd-run -p), and the unit file that test_unit_hardening
# scores: one list for both. md-share needs no thread priorities, so @resources is refused too.
HARDENING = (
    "DynamicUser=yes", f"RuntimeDirectory={UNIT}", *transient.SANDBOX, "PrivateMounts=yes",
    "ProcSubset=pid", "SystemCallFilter=~@resources", "TimeoutStopSec=10",
)

# md-share as a unit of a rootless host's systemd --user (transient.USER_SANDBOX says why so few).
USER_HARDENING = (*transient.USER_SANDBOX, "SystemCallFilter=~@resources", "TimeoutStopSec=10")

# The start script, and the preludes that give it md_share_launch (see md-share-start.sh).
START = shell.TEMPLATES / "md-share-start.sh"
_LAUNCH = shell.TEMPLATES / "md-share-launch.sh"  # a host with root: a unit, or nobody's process
_UNIT = shell.TEMPLATES / "md-share-unit.sh"  # md_share_as_unit
_DETACH = shell.TEMPLATES / "md-share-detach.sh"  # md_share_detach
_PID = shell.TEMPLATES / "md-share-pid.sh"  # stop_pid
STOP = shell.TEMPLATES / "md-share-stop.sh"  # at the end of a run (stop_script)
# A rootless host: md-share as the login user, its pid file and log in the user's folders made
# the user's alone, then started as a unit of the user's manager or (runit) a process of its own.
_USER_LAUNCH = ('md_share_launch() {{\n'
                '  mkdir -p "$(dirname "$PID")" && chmod 700 "$(dirname "$PID")" "$(dirname "$LOG")" '
                '|| exit 1\n  {start} "$@"\n}}')


def properties(allow) -> list[str]:
    """The transient unit's settings: HARDENING, LOG, and the addresses it may talk to
    (`allow`: the clients' addresses; one that is not an IP literal md-share refuses itself)."""
    ips = []
    for a in allow:
        try:
            ips.append(str(ipaddress.ip_address(a)))
        except ValueError:
            pass
    return [*HARDENING, f"StandardOutput=append:{LOG}", f"StandardError=append:{LOG}",
            "IPAddressDeny=any", " ".join(["IPAddressAllow=127.0.0.0/8 ::1/128", *ips])]


def user_properties(log: str) -> list[str]:
    """The settings of md-share's unit under a rootless host's systemd --user, its log `log`."""
    return [*USER_HARDENING, f"StandardOutput=append:{log}", f"StandardError=append:{log}"]


def paths(layout) -> dict[str, str]:
    """The start script's paths on a host of `layout`: PID, OLD_PID, LOG and BOOTED on a host
    with root; on a rootless host PID and LOG in the login user's folders, and no earlier md-share
    of root's to stop."""
    if not layout.rootless:
        return {"PID": PID, "OLD_PID": OLD_PID, "LOG": LOG, "BOOTED": transient.BOOTED}
    return {"PID": f"{layout.run}/md-share.pid", "OLD_PID": "",
            "LOG": f"{layout.cache}/md-share.log"}


def server_path(prefix: str) -> str:
    return f"{prefix}/tools/{NAME}"


reverse_port = distribution.reverse_port  # `-R 127.0.0.1:PORT:127.0.0.1:model_share_port`


def way(cluster) -> str:
    """How md-share's bytes travel, as a plan says it."""
    if cluster.network.forwarded:
        return "through the ssh forwards"
    return "through the WireGuard tunnel" if cluster.network.tunnel else "over the LAN"


def address(cluster, host: str) -> str:
    """`host`'s address for md-share (the one a source binds, the one a client's connections
    come from): loopback under network.transport: ssh (they arrive through the forwards'
    reverse ends), else its cluster address."""
    return LOOPBACK if cluster.network.forwarded else cluster.source_address(cluster.host(host))


def url(cluster, source: str, sha256: str, client: str) -> str:
    """Where host `client` fetches the file whose content is `sha256` from host `source`: the
    source's cluster address, or under network.transport: ssh the client's own loopback port
    that the source's forward carries back to it.

    md-share names files by their sha256, never by model: an md-share an earlier step (or a
    run that never released its lock) left running may serve other bytes under a model's name,
    and a client that read those would only find out at its final sha256 check. By content, such a
    server answers 404 until the new one replaces it, and the client tries again."""
    if cluster.network.forwarded:
        port = reverse_port(cluster, source, client)
        if port is None:
            raise PlanError(f"{client} gets no model bytes from {source} through a forward",
                            hint="every host that gets a model's bytes is a worker of its one "
                                 "llama-server, whose host is the source: report this")
        return f"http://{LOOPBACK}:{port}/models/{sha256}"
    return lan_url(cluster, source, sha256)


def lan_url(cluster, source: str, name: str) -> str:
    """Where another host fetches the file md-share on host `source` serves as `name`, over the
    hosts' network (the source's cluster address, its tunnel address under WireGuard): a model
    by its sha256 (url()), a llama.cpp build's tarball by its build key (llama_cpp.copy, which
    runs only where no forward must carry it)."""
    address = cluster.source_address(cluster.host(source))
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{model_share_port}/models/{name}"


def start(cluster, host, files: dict[str, str], clients, growing: dict | None = None) -> list[str]:
    """The commands that (re)start md-share on `host` for `clients` (Hosts).

    + files: sha256 of a file -> its path on `host`
    + growing: sha256 -> (partial path, final size), for a file still being downloaded
    """
    args = ["--bind", address(cluster, host.name), "--port", model_share_port,
            "--idle", IDLE, "--max", MAX, "--wait", WAIT]
    allow = sorted({address(cluster, c.name) for c in clients})
    for client in allow:
        args += ["--allow", client]
    for name, path in files.items():
        args += ["--file", f"{name}={path}"]
    for name, (partial, size) in (growing or {}).items():
        args += ["--growing", f"{name}={partial}:{int(size)}"]
    server = server_path(host.layout.prefix)
    layout = host.layout
    return [shell.write_file(server, SERVER.read_text(), "0755"),
            start_script(server, args, host.name, allow, layout.manager, **paths(layout))]


def start_script(server: str, args: list, host_name: str, allow, manager: str = "",
                 **where: str) -> str:
    """The script that (re)starts md-share `server` with `args` (`allow`: the clients' addresses);
    `manager`: a rootless host's (Layout.manager), "" on a host with root; `where`: the paths
    (paths(), which a host with root has by default; tests run it in a folder of their own)."""
    if manager not in (SYSTEMD_USER, RUNIT):
        where = {"PID": PID, "OLD_PID": OLD_PID, "LOG": LOG, "BOOTED": transient.BOOTED, **where}
    if manager == SYSTEMD_USER:
        prelude = [shell.SYSTEMD_RUN, transient.USER_SCOPE,
                   _unit_function(["--user"], user_properties(where["LOG"])),
                   shell.body(_UNIT), _USER_LAUNCH.format(start="md_share_as_unit")]
    elif manager == RUNIT:
        prelude = [shell.body(_DETACH),
                   _USER_LAUNCH.format(start='stop_pid "$PID"; md_share_detach')]
    else:
        prelude = [shell.SYSTEMD_RUN, _unit_function([], properties(allow)), shell.body(_UNIT),
                   shell.body(_DETACH), shell.body(_LAUNCH)]
    prelude.insert(0, shell.body(_PID))
    return shell.template(START, args=args, prelude="\n".join(prelude), PY=PYTHON, SERVER=server,
                          UNIT=UNIT, HOST=host_name, PORT=model_share_port, **where)


def stop_script(layout, lock: str, token: str) -> str:
    """md-share stopped on a host of `layout` while this run (`token`) holds host lock `lock`:
    the host lock's release runs it first (engine/locks.py), so md-share lives for one run."""
    where = paths(layout)
    return shell.template(STOP, prelude=shell.body(_PID), UNIT=UNIT, MANAGER=layout.manager,
                          BOOTED=transient.BOOTED, PID=where["PID"],
                          SERVER=server_path(layout.prefix), LOCK=lock, TOKEN=token)


def _unit_function(scope: list[str], props: list[str]) -> str:
    """md_share_unit: md_systemd_run with md-share's unit options (`scope`: ["--user"] for the
    login user's manager) and settings `props`."""
    unit = shell.join(["md_systemd_run", *scope, "--quiet", "--collect", f"--unit={UNIT}",
                       "--description=md-share: model files for the cluster (meshdeploy)",
                       *(w for p in props for w in ("-p", p)), "--"])
    return f'md_share_unit() {{ {unit} "$@"; }}'
