"""logs and exec as the CLI runs them: ad-hoc work across hosts over fabric (each returns an
exit code).

Kept apart from meshdeploy.commands.cluster on purpose: that module patches the standard library
for gevent (pyinfra's concurrency), and fabric runs each host in a real thread.
"""

from __future__ import annotations

import queue
import sys
import threading
import time

from tabulate import tabulate

from meshdeploy import errors
from meshdeploy.commands.logs import (
    DEFAULT_LINES,
    FOLLOW,
    HostStream,
    host_script,
    merge,
    parse,
    render,
    select,
    since_value,
    terminal_text,
    width,
)
from meshdeploy.config.load import load_cluster
from meshdeploy.core import registry, shell
from meshdeploy.remote import connections as remote
from meshdeploy.remote import ssh_settings


def _open(cluster, names: list[str], args) -> remote.Hosts:
    settings = [ssh_settings.resolve(cluster.host(n),
                                     accept_new=getattr(args, "accept_new_host_keys", False))
                for n in names]
    for warning in ssh_settings.no_check_warnings(settings):
        print(f"warning: {warning}", file=sys.stderr)
    hosts = remote.connect(settings)
    for name, reason in hosts.unreachable.items():
        print(f"{name}: unreachable ({terminal_text(reason)})", file=sys.stderr)
    return hosts


def _now() -> int:
    return time.time_ns() // 1000


# -- logs ------------------------------------------------------------------------------------

def logs(args) -> int:
    cluster = load_cluster(args.file)
    host_names = [h.name for h in cluster.hosts]
    sources = select(registry.log_sources(cluster), host_names, args.targets)
    by_host = {n: [s for s in sources if s.host == n] for n in host_names}
    by_host = {n: s for n, s in by_host.items() if s}
    since = since_value(args.since)
    lines = args.lines if args.lines is not None else (None if since else DEFAULT_LINES)
    hosts = _open(cluster, list(by_host), args)
    streams = {n: HostStream(n, host_names.index(n), by_host[n]) for n in by_host}
    scripts = {n: remote.as_root(host_script(by_host[n], lines, since, args.follow),
                                 cluster.host(n).sudo) for n in by_host}
    shown = width(sources)
    try:
        if args.follow:
            answered = _follow(hosts, streams, scripts, shown)
        else:
            answered = _backlog(hosts, streams, scripts, shown)
    finally:
        hosts.close()
    # Only when no host could show its logs is the command a failure: one host down is what
    # logs are read for.
    return errors.OK if answered else errors.CONNECT


def _backlog(hosts, streams, scripts, shown) -> int:
    results = remote.each(hosts, lambda name, conn: conn.run(
        scripts[name], hide=True, warn=True, in_stream=False))
    per_host = []
    for name, result in results.items():
        if _failed(name, result):
            continue
        per_host.append(parse(streams[name], result.stdout, _now()))
    for line in merge(per_host):
        print(render(line, shown))
    return len(per_host)


def _failed(name, result) -> bool:
    if isinstance(result, Exception):
        print(f"{name}: unreachable ({terminal_text(remote.reason(result))})", file=sys.stderr)
        return True
    if result.exited != 0:
        said = (result.stderr.strip().splitlines() or ["no message"])[-1]
        print(f"{name}: reading the logs failed (exit {result.exited}): {terminal_text(said)}",
              file=sys.stderr)
        return True
    return False


class _Lines:
    """A file-like object for invoke's out_stream: whole lines go to the queue as they come."""

    def __init__(self, name, q):
        self.name, self.q, self.partial = name, q, ""

    def write(self, data: str) -> None:
        self.partial += data
        *whole, self.partial = self.partial.split("\n")
        for line in whole:
            self.q.put((self.name, line))

    def flush(self) -> None:
        pass


_END = object()


def _follow(hosts, streams, scripts, shown) -> int:
    """Backlog of every host merged, then each line as it arrives, until Ctrl-C or every stream
    ended. Returns how many hosts streamed."""
    q: queue.Queue = queue.Queue()

    def one(name, conn):
        try:
            result = conn.run(scripts[name], hide=False, warn=True, in_stream=False,
                              out_stream=_Lines(name, q), err_stream=_Lines(name, queue.Queue()))
        except Exception as exc:  # the connection dropped or was closed
            result = exc
        q.put((name, _END, result))

    for name, conn in hosts.connections.items():
        threading.Thread(target=one, args=(name, conn), daemon=True).start()
    waiting = set(hosts.connections)  # hosts whose backlog has not ended yet
    running = set(hosts.connections)
    backlog: dict = {n: [] for n in hosts.connections}
    seen: dict = {n: set() for n in hosts.connections}
    streamed = 0
    try:
        while running:
            item = q.get()
            name = item[0]
            if item[1] is _END:
                running.discard(name)
                waiting.discard(name)
                if not _failed(name, item[2]) and streams[name].following:
                    print(f"{name}: log stream ended", file=sys.stderr)
            else:
                got = streams[name].feed(item[1], _now())
                if got == FOLLOW:
                    waiting.discard(name)
                    streamed += 1
                    seen[name] = {line.cursor for line in backlog[name]}
                elif name in waiting:
                    backlog[name] += got
                else:
                    for line in got:
                        if line.cursor is None or line.cursor not in seen[name]:
                            print(render(line, shown), flush=True)
            if backlog is not None and not waiting:
                for line in merge(sorted(b, key=lambda x: x.time) for b in backlog.values()):
                    print(render(line, shown))
                sys.stdout.flush()
                backlog = None
    except KeyboardInterrupt:
        pass  # Ctrl-C is how -f ends; closing the connections ends the remote readers
    return streamed


# -- exec ------------------------------------------------------------------------------------

def command_text(argv: list[str]) -> str:
    """The shell text of `exec -- ARGV`: one word is a shell snippet run as written (pipes,
    $VARS, globs: like ansible's shell module); several words are one command whose words are
    passed literally, each quoted (like ansible's -a)."""
    if not argv:
        raise errors.MeshdeployError("exec needs a command after --",
                                     hint="meshdeploy exec FILE -- uptime")
    if len(argv) == 1:
        return argv[0]
    return shell.join(argv)


def run_exec(args) -> int:
    cluster = load_cluster(args.file)
    names = [h.name for h in cluster.hosts]
    if args.limit:
        unknown = [n for n in args.limit if n not in names]
        if unknown:
            raise errors.MeshdeployError(f"--limit names unknown host(s): {', '.join(unknown)}",
                                         hint=f"hosts: {', '.join(names)}")
        names = [n for n in names if n in args.limit]
    text = command_text(args.argv)
    # stderr joins stdout so each host's output reads in the order it was written. --sudo on
    # the local host is sudo only when meshdeploy does not run as root (it may have no sudo).
    commands = {n: remote.as_root(text, args.sudo and (cluster.host(n).sudo
                                                      or not cluster.host(n).local)) + " 2>&1"
                for n in names}
    hosts = _open(cluster, names, args)
    try:
        results = remote.each(hosts, lambda name, conn: conn.run(
            commands[name], warn=True, hide=True, in_stream=False))
        by_name = {n: (hosts.connections[n], r) for n, r in results.items()}
    finally:
        hosts.close()
    rows = []
    for name in names:
        if name in hosts.unreachable:
            rows.append([name, "unreachable", "-", terminal_text(hosts.unreachable[name])])
            continue
        conn, result = by_name[name]
        if isinstance(result, Exception):
            hosts.unreachable[name] = remote.reason(result)
            rows.append([name, "unreachable", "-", terminal_text(hosts.unreachable[name])])
            continue
        # The host's output, failed or not, is shown, never run by the terminal.
        output = terminal_text(result.stdout)
        print(f"== {name} (exit {result.exited}, {conn.seconds:.2f} s) ==")
        sys.stdout.write(output if output.endswith("\n") or not output else output + "\n")
        rows.append([name, result.exited, f"{conn.seconds:.2f}", ""])
    print()
    print(tabulate(rows, headers=["host", "exit", "seconds", "note"]))
    return exit_code([r[1] for r in rows])


def exit_code(exits: list) -> int:
    """exec's exit: 4 when a host was unreachable, else 1 when the command failed anywhere."""
    if "unreachable" in exits:
        return errors.CONNECT
    return errors.ERROR if any(e != 0 for e in exits) else errors.OK
