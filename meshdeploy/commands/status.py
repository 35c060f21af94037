"""meshdeploy status: per host and service, what runs and whether it answers."""

from __future__ import annotations

import argparse
import json
import secrets
from dataclasses import asdict, dataclass

from meshdeploy import errors
from meshdeploy.commands import common, options
from meshdeploy.core.loading import load_cluster
from meshdeploy.config.addresses import local_address
from meshdeploy.config.model import RUNIT, SYSTEMD_USER
from meshdeploy.core import registry, rpc_hello, shell
from meshdeploy.core.paths import llama_cpp_paths
from meshdeploy.engine import hosts as cluster_hosts
from meshdeploy.engine import server_api
from meshdeploy.remote import reasons
from meshdeploy.views import status as view

NAME = "status"
HELP = "show what runs on the hosts and whether it is healthy"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help="machine-readable status on stdout")
    p.add_argument("--window", type=options.whole_seconds(0, 300), default=WINDOW,
                   metavar="SECONDS",
                   help="read each llama-server's counters twice, this far apart, for its recent "
                        "generation rate (0: only the mean since it started; default: "
                        "%(default)s)")
    options.limit(p)
    options.host_keys(p)
    p.epilog = ("Exit 0 when every service answers; 9 (degraded) when a host cannot be reached "
                "or a service is away but every llama-server answers; 10 (down) when a "
                "llama-server does not answer or its host cannot be reached.")


WINDOW = 5  # seconds between the two samples of a llama-server's /metrics counters


@dataclass(frozen=True)
class Args(options.Arguments):
    file: str
    json: bool
    window: int
    limit: list[str] | None
    accept_new_host_keys: bool


def run(args: Args) -> int:
    common.patch_for_gevent()
    cluster = load_cluster(args.file)
    # A host that cannot be reached is a row of its own; the others are still asked.
    session = cluster_hosts.open_session(cluster, args.limit, args.accept_new_host_keys,
                                         tolerate=True)
    try:
        rows = collect(session, args.window)
        servers = [s.name for s in session.cluster.servers
                   if s.host in {h.name for h in session.hosts()}]
    finally:
        session.close()
    state = verdict(rows, servers)
    print(view.render_json(rows) if args.json else view.render_text(rows, state))
    return EXIT[state]


HEALTHY, DEGRADED, DOWN = "healthy", "degraded", "down"
EXIT = {HEALTHY: errors.OK, DEGRADED: errors.DEGRADED, DOWN: errors.DOWN}


def server_service(name: str) -> str:
    """The `service` of a llama-server's row."""
    return f"llama-server {name}"


def verdict(rows: list[dict], servers: list[str]) -> str:
    """healthy, degraded or down, from the rows and the names of the servers whose hosts this
    run covers: down when one of those servers has no healthy row of its own (it does not
    answer, or its host could not be reached); degraded when every one answers but some row
    is not healthy (a host that cannot be reached, an rpc-server, a forward, a role's row:
    also one a server adds to say it runs without a worker); else healthy."""
    answering = {r["service"] for r in rows if r["healthy"]}
    if any(server_service(name) not in answering for name in servers):
        return DOWN
    return HEALTHY if all(r["healthy"] for r in rows) else DEGRADED


def unreachable_row(host: str, why: str) -> dict:
    """The one row of a host that could not be reached (its services are not known)."""
    return {"host": host, "service": "-", "unit": "unknown", "answer": f"unreachable: {why}",
            "protocol": None, "healthy": False, "reachable": False}


# rpc-server serves one client at a time and listens with a backlog of 1 (ggml-rpc's
# listen(sockfd, 1)): while a llama-server holds it, a connect completes in the kernel's accept
# queue without rpc-server knowing, and a closed probe stays queued until rpc-server accepts
# again; once the queue is full the kernel drops every further SYN, a reconnecting
# llama-server's too. So the worker's socket table is read first (/proc/net/tcp: the
# listener's queue, and the connections rpc-server accepted, which have a socket file), and
# the HELLO connects only to an rpc-server that serves nobody and has nobody waiting. Where no
# table can be read (macOS, Android's SELinux) it connects, and a timeout is "busy": the queue
# is full, not the port closed. Prints one word (a protocol version, busy, queued, down,
# no-hello), then `peers=A,B` and `queued=N` where the table was read.
HELLO = rpc_hello.FUNCTIONS + r"""
def table(port):
    found, listening, queued, peers = False, False, 0, []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        found = True
        for row in rows:
            w = row.split()
            if len(w) < 10 or int(w[1].rsplit(":", 1)[1], 16) != port:
                continue
            if w[3] == "0A":
                listening = True
                queued += int(w[4].split(":")[1], 16)
            elif w[3] == "01" and w[9] != "0":
                a = w[2].rsplit(":", 1)[0]
                peers.append(socket.inet_ntoa(struct.pack("=I", int(a, 16))) if len(a) == 8
                             else "ipv6")
    return (listening, queued, peers) if found else None
port = int(sys.argv[2])
t = table(port)
if t is not None:
    listening, queued, peers = t
    more = " peers=%s queued=%d" % (",".join(peers) or "-", queued)
    if not listening:
        print("down" + more); sys.exit()
    if peers:
        print("busy" + more); sys.exit()
    if queued:
        print("queued" + more); sys.exit()
else:
    more = ""
try:
    s = socket.create_connection((sys.argv[1], port), timeout=2)
except socket.timeout:
    print("busy" + more); sys.exit()
except OSError:
    print("down" + more); sys.exit()
try:
    d = hello(s)
    print("%d.%d.%d" % (d[0], d[1], d[2]) + more)
except socket.timeout:
    print("busy" + more)
except (OSError, EOFError):
    print("no-hello" + more)
"""


# One line per service; every value arrives as a positional parameter, never as shell text.
_RPC = ('printf \'rpc %s %s %s\\n\' "$2" "$(systemctl is-active "$3" 2>/dev/null)" '
        '"$(python3 -c "$HELLO" "$1" "$2" 2>/dev/null || echo n/a)"')
# md_get PATH: the server's PATH with its API key where there is one, the login user may read
# its file and md_keycheck found every listener on the port to be the server's own unit (a
# process that took the port while the server was down gets no key): on curl's standard input
# (-H @-), never on a command line `ps` shows. /v1/models and /metrics need the key when one is
# set (only /health does not). md_keycheck prints `keyless NAME OWN<tab>VERDICT` where it
# withholds the key (core/templates/listener-owner.sh's md_owner says who holds the port).
# (md_get's own $1 is PATH; the server's arguments follow it: name, unit, URL, key file,
# address, port.)
_MD_GET = ('md_keycheck() { md_keyed=; [ -n "$4" ] && [ -r "$4" ] || return 0; '
           'md_why=$(md_owner "$2" "$5" "$6"); '
           'md_verdict=$(printf \'%s\\n\' "$md_why" | tail -n 1); '
           'if [ "$md_verdict" = owned ]; then md_keyed=1; else '
           'printf \'keyless %s %s\\t%s\\n\' "$1" "$(printf \'%s\\n\' "$md_why" | '
           'sed -n \'s/^unit //p\')" "$md_verdict"; fi; }; '
           'md_get() { { [ -n "$md_keyed" ] && '
           'printf \'Authorization: Bearer %s\\n\' "$(cat "$5")"; } | '
           'curl -s --max-time 5 -H @- "$4$1"; }; ')
_KEYCHECK = 'md_keycheck "$@"; '  # after the server's own line: a `keyless` line joins its row
# `metrics NAME COUNTERS` (METRICS_AGAIN: `metrics-again`, the second sample, `window` s later).
_METRICS = ('printf \'%s %s %s\\n\' "${KIND:-metrics}" "$1" "$(md_get /metrics "$@" | '
            # Two POSIX expressions, not GNU's \| alternation: any host's sed reads them.
            'sed -n -e \'s/^llamacpp:tokens_predicted_total \\([0-9.e+-]*\\)$/'
            'tokens_predicted_total=\\1/p\' -e \'s/^llamacpp:tokens_predicted_seconds_total '
            '\\([0-9.e+-]*\\)$/tokens_predicted_seconds_total=\\1/p\' | tr \'\\n\' \' \')"')
_SERVER = (_MD_GET
           + 'printf \'server %s %s %s\\n\' "$1" "$(systemctl is-active "$2" 2>/dev/null)" '
           '"$(curl -s -o /dev/null -w \'%{http_code}\' --max-time 5 "$3/health")"; '
           + _KEYCHECK +
           'printf \'models %s %s\\n\' "$1" "$(md_get /v1/models "$@" | tr -d \'\\n\')"; '
           + _METRICS)
METRICS_AGAIN = "metrics-again"


# A rootless host's manager answers "is it running" in its own words: md_active UNIT prints
# systemctl's (active, inactive, failed, ...) for it. runit: `sv status` on the unit's service
# folder under $SVDIR_MD ("run:" is active, "down:" inactive, "fail:" failed: no runsv).
_ACTIVE = {
    SYSTEMD_USER: 'md_active() { systemctl --user is-active "$1" 2>/dev/null; }',
    RUNIT: ('md_active() { case "$(sv status "$SVDIR_MD/$1" 2>/dev/null)" in '
            'run:*) echo active ;; down:*) echo inactive ;; fail:*) echo failed ;; '
            '*) echo unknown ;; esac; }'),
}


def host_script(cluster, host, nonce: str = "", window: int = 0) -> str:
    """The status probe of one host: runs as the login user (nothing here needs root). A role's
    lines follow a mark with this run's `nonce` on a line of its own (role_rows). A rootless
    host's services are asked through its own manager (md_active). With a `window`, each
    llama-server's counters are read again that many seconds after the first reading."""
    p = llama_cpp_paths(host.layout.prefix)
    lines = [shell.script('printf \'proto %s\\n\' "$(sed -n \'s/^proto=//p\' "$CURRENT/manifest" '
                          '2>/dev/null)"', CURRENT=p["current"])]
    servers = [s for s in cluster.servers if s.host == host.name]
    rpc_body, server_body = _RPC, _SERVER
    active = _ACTIVE.get(host.layout.manager)
    keyed = any(s.api_key_file for s in servers)
    if active or keyed:
        # How the host's units run: md_active's, and md_owner's (md_keycheck) where a key is.
        lines.append(shell.script(active or "", MANAGER=host.layout.manager,
                                  SVDIR_MD=host.layout.services))
    if keyed:
        lines.append(shell.LISTENER_OWNER)
    if active:
        rpc_body = _RPC.replace('systemctl is-active "$3" 2>/dev/null', 'md_active "$3"')
        server_body = _SERVER.replace('systemctl is-active "$2" 2>/dev/null', 'md_active "$2"')
    for rpc in host.rpc_servers:
        lines.append(shell.subshell(shell.script(rpc_body,
                                                 args=[rpc.bind, rpc.port, rpc.unit_name],
                                                 HELLO=HELLO)))
    for server in servers:
        lines.append(shell.subshell(shell.script(server_body, args=_server_args(server))))
    if servers and window:
        lines.append(shell.command("sleep", int(window)))
        lines += [shell.subshell(shell.script(_MD_GET + _KEYCHECK + _METRICS,
                                              args=_server_args(s), KIND=METRICS_AGAIN))
                  for s in servers]
    for name, probe in registry.status_probes(cluster, host):
        lines += [shell.command("printf", f"\\n{ROLE_MARK}%s %s\\n", nonce, name),
                  shell.subshell(probe.script)]
    return "\n".join(lines) + "\ntrue"


def _server_args(server) -> list:
    return [server.name, server.unit_name, server.local_url, server.api_key_file or "",
            local_address(server.bind), server.port]


ROLE_MARK = "@role-"  # + the run's nonce: the line before a role's own status lines


def role_rows(cluster, host, lines: list[str],
              nonce: str = "") -> tuple[list[str], list[dict]]:
    """The probe's own lines (before the first role's mark), and the rows the roles' parse
    functions make of the non-empty lines after their marks. A mark counts only with this run's
    nonce and as the next role expected, so a host's output cannot move lines to another role
    (the mark's leading newline ends a role's last line when it has none)."""
    expected = [name for name, _ in registry.status_probes(cluster, host)]
    parts: dict[str, list[str]] = {}
    own: list[str] = []
    current = own
    for line in lines:
        if expected and line == f"{ROLE_MARK}{nonce} {expected[0]}":
            current = parts[expected.pop(0)] = []
        elif line:
            current.append(line)
    rows = [{"host": host.name, **asdict(row)}
            for name, probe in registry.status_probes(cluster, host)
            for row in probe.parse(parts.get(name, []))]
    return own, rows


def recent(first: str, second: str, window: int) -> dict:
    """A server row's recent generation figures from two samples of its /metrics counters,
    `window` seconds apart: the tokens generated between them and their rate (tokens per second
    of generating). llama.cpp adds a completion to its counters when the completion ends, so
    the figures are those of the completions that ended in the window; None where none did or
    a sample had no counters (a counter that went down is a server that restarted)."""
    a, b = generation(first), generation(second)
    none = {"recent_tps": None, "recent_generated": None, "window": window}
    if a["generated"] is None or b["generated"] is None:
        return none
    tokens = b["generated"] - a["generated"]
    seconds = (_counters(second)["tokens_predicted_seconds_total"]
               - _counters(first)["tokens_predicted_seconds_total"])
    if tokens < 0 or seconds < 0:
        return none
    return {"recent_tps": round(tokens / seconds, 2) if tokens and seconds > 0 else None,
            "recent_generated": int(tokens), "window": window}


def _counters(body: str) -> dict[str, float]:
    values = {}
    for word in body.split():
        key, _, value = word.partition("=")
        try:
            values[key] = float(value)
        except ValueError:
            continue
    return values


def generation(body: str) -> dict:
    """A server row's generation figures from its /metrics counters (`name=value` words):
    tokens generated since it started and their mean rate; None where /metrics gave none
    (no --metrics, an API key the login user cannot read, or nothing generated yet)."""
    values = _counters(body)
    tokens, seconds = (values.get(k) for k in ("tokens_predicted_total",
                                              "tokens_predicted_seconds_total"))
    if tokens is None or seconds is None:
        return {"gen_tps": None, "generated": None}
    return {"gen_tps": round(tokens / seconds, 2) if tokens and seconds > 0 else None,
            "generated": int(tokens)}


_NOT_A_VERSION = ("busy", "queued", "down", "no-hello", "n/a")


def rpc_row(host: str, rest: str, proto: str = "") -> dict:
    """A status row from an rpc-server's line (`PORT STATE ANSWER [peers=A,B queued=N]`: the
    unit's state and HELLO's answer). `busy` is healthy: a client (its llama-server) holds
    rpc-server, which serves one at a time, or a connect timed out in its full backlog; only a
    port nothing listens on is `not listening`."""
    words = rest.split()
    port, state, hello = (words + ["", "", ""])[:3]
    seen = dict(w.split("=", 1) for w in words[3:] if "=" in w)
    peers = [p for p in seen.get("peers", "-").split(",") if p and p != "-"]
    queued = int(seen["queued"]) if seen.get("queued", "").isdigit() else 0
    live = hello if hello not in _NOT_A_VERSION else None
    if hello == "busy":
        answer = (f"listening (in use by {', '.join(peers)})" if peers
                  else "listening (busy: a client is connected)")
    else:
        answer = f"protocol {live}" if live else {
            "down": "not listening",
            "queued": f"listening, {queued} connection(s) queued and none accepted",
            "no-hello": "listening, no HELLO reply"}.get(hello, hello)
    if queued and hello != "queued":
        answer += f"; {queued} connection(s) queued"
    return {"host": host, "service": f"rpc-server :{port}", "unit": state, "answer": answer,
            "protocol": live or proto or None,
            "healthy": state == "active" and hello not in ("down", "no-hello", "queued")}


def collect(session, window: int = 0) -> list[dict]:
    import gevent

    cluster = session.cluster
    rows: list[dict] = []

    def one(host):
        try:
            read(host)
        except Exception as exc:  # a host's odd output is its own row, never a lost host
            lost = getattr(session, "connection_lost", lambda name: False)(host.name)
            rows.append(unreachable_row(host.name, f"connection lost: {reasons.reason(exc)}")
                        if lost else
                        {"host": host.name, "service": "-", "unit": "unknown",
                         "answer": f"status output unreadable: {type(exc).__name__}: {exc}",
                         "protocol": None, "healthy": False})

    def read(host):
        nonce = secrets.token_hex(8)
        ok, output = session.run(host.name, host_script(cluster, host, nonce, window),
                                 sudo=False)
        proto = ""
        first: dict[str, str] = {}  # server name -> its first /metrics sample
        own, extra = role_rows(cluster, host, output.stdout_lines, nonce) if ok else ([], [])
        rows.extend(extra)
        for line in own:
            kind, _, rest = line.partition(" ")
            if kind == "proto":
                proto = rest.strip()
            elif kind == "rpc":
                rows.append(rpc_row(host.name, rest, proto))
            elif kind == "server":
                name, state, code = (rest.split() + ["", "", ""])[:3]
                rows.append({"host": host.name, "service": server_service(name), "unit": state,
                             "answer": {"200": "healthy", "503": "loading"}.get(
                                 code, f"HTTP {code or '-'}"),
                             "protocol": proto or None, "model": None,
                             "gen_tps": None, "generated": None, "recent_tps": None,
                             "recent_generated": None, "window": None,
                             "healthy": state == "active" and code == "200"})
            elif kind == "metrics":
                name, _, body = rest.partition(" ")
                first[name] = body
                for row in rows:
                    if row["host"] == host.name and row["service"] == f"llama-server {name}":
                        row.update(generation(body))
            elif kind == METRICS_AGAIN:
                name, _, body = rest.partition(" ")
                for row in rows:
                    if row["host"] == host.name and row["service"] == f"llama-server {name}":
                        row.update(recent(first.get(name, ""), body, window))
            elif kind == "keyless":
                name, _, body = rest.partition(" ")
                own, _, verdict = body.partition("\t")
                unit = next((s.unit_name for s in cluster.servers
                             if s.host == host.name and s.name == name), name)
                why = server_api.foreign_listener([f"unit {own}", verdict], unit)
                for row in rows:
                    if row["host"] == host.name and row["service"] == f"llama-server {name}" \
                            and why and "key_withheld" not in row:
                        row["key_withheld"] = why
                        row["answer"] += f"; API key not sent: {why}"
                        # Someone else answers on the server's port: not a healthy server.
                        row["healthy"] = row["healthy"] and not verdict.startswith("foreign")
            elif kind == "models":
                name, _, body = rest.partition(" ")
                try:
                    ids = [m.get("id") for m in json.loads(body).get("data", [])]
                except (ValueError, AttributeError, TypeError):
                    ids = []
                for row in rows:
                    if row["host"] == host.name and row["service"] == f"llama-server {name}":
                        row["model"] = ", ".join(str(i) for i in ids if i) or None
        if not ok:
            rows.append({"host": host.name, "service": "-", "unit": "unknown",
                         "answer": "status probe failed", "protocol": None, "healthy": False})

    away = getattr(session, "unreachable", {})  # {host: why} (Session.connect(tolerate=True))
    gevent.joinall([gevent.spawn(one, h) for h in session.hosts() if h.name not in away])
    rows += [unreachable_row(name, why) for name, why in away.items()]
    order = {h.name: i for i, h in enumerate(cluster.hosts)}
    rows.sort(key=lambda r: (order[r["host"]], r["service"]))
    return rows
