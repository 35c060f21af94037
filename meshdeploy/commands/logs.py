"""meshdeploy logs: the services' logs from every host, merged by time (views/log_lines.py reads
and merges them). fabric runs each host in a real thread: nothing here patches for gevent, and
remote.connections (fabric) is imported where it is used, not when the parser is built."""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from dataclasses import dataclass

from meshdeploy import errors
from meshdeploy.commands import common, options
from meshdeploy.core.loading import load_cluster
from meshdeploy.core import registry
from meshdeploy.engine import hosts as cluster_hosts
from meshdeploy.views import completion, notices
from meshdeploy.views.log_lines import (
    DEFAULT_LINES,
    FOLLOW,
    HostStream,
    host_script,
    merge,
    parse,
    select,
    since_cutoff,
    since_value,
)
from meshdeploy.views.logs import render, width

NAME = "logs"
HELP = "the services' logs from every host, merged by time"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE")
    p.add_argument("targets", nargs="*", metavar="HOST|SERVICE",
                   help="only these: host names, rpc-server, llama-server, a server name, a unit "
                        "name or an rpc-server's host:port (default: every service)"
                   ).completer = completion.complete_log_targets
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing new lines as they come, until Ctrl-C (exit 0)")
    p.add_argument("--since", metavar="WHEN", help="only lines since 10m, 2h, 1d ago or a date "
                                                   "(YYYY-MM-DD [HH:MM[:SS]])")
    p.add_argument("-n", "--lines", type=int, metavar="N",
                   help="the last N lines of each service (default 10; all with --since)")
    options.limit(p)
    options.host_keys(p)
    p.epilog = ("A host that cannot be reached is named on stderr and the others are shown; the "
                "exit code is 4 only when no host could be read.")


@dataclass(frozen=True)
class Args(options.Arguments):
    file: str
    targets: list[str]
    follow: bool
    since: str | None
    lines: int | None
    limit: list[str] | None
    accept_new_host_keys: bool


def run(args: Args) -> int:
    from meshdeploy.remote import connections as remote

    cluster = load_cluster(args.file)
    host_names = [h.name for h in cluster.hosts]
    sources = select(registry.log_sources(cluster), host_names, args.targets)
    by_host = {n: [s for s in sources if s.host == n]
               for n in cluster_hosts.limited(cluster, args.limit)}
    by_host = {n: s for n, s in by_host.items() if s}
    if not by_host and args.limit:
        raise errors.MeshdeployError(f"--limit {','.join(args.limit)} leaves none of the chosen "
                                     "services", hint="name hosts that run them")
    since = since_value(args.since)
    lines = args.lines if args.lines is not None else (None if since else DEFAULT_LINES)
    hosts = common.open_hosts(cluster, list(by_host), args.accept_new_host_keys)
    # A rootless host's logs are its own manager's (journalctl --user, svlogd's files): its
    # layout is read first, and its sources named again with it.
    cluster, unread = common.read_layouts(cluster, hosts)
    for name, reason in unread.items():
        print(notices.folders_unread(name, reason), file=sys.stderr)
        hosts.connections.pop(name).close()
        by_host.pop(name)
    chosen = {(s.host, s.service) for s in sources}
    by_host = {n: [s for s in registry.log_sources(cluster)
                   if s.host == n and (s.host, s.service) in chosen] for n in by_host}
    cutoff = since_cutoff(args.since)  # svlogd's lines are kept from here on, by their time
    streams = {n: HostStream(n, host_names.index(n), by_host[n], since=cutoff) for n in by_host}
    scripts = {n: remote.as_root(host_script(by_host[n], lines, since, args.follow,
                                             _manager(cluster.host(n))),
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


def _manager(host) -> str:
    """A rootless host's service manager ("" for a host with root, or one not reached)."""
    return host.layout.manager if host.layout is not None else ""


def _now() -> int:
    return time.time_ns() // 1000


def _backlog(hosts, streams, scripts, shown) -> int:
    from meshdeploy.remote import connections as remote

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
    """Whether a host's reading failed (the exception or exit named on stderr)."""
    from meshdeploy.remote import connections as remote

    if isinstance(result, Exception):
        print(notices.unreachable(name, remote.reason(result)), file=sys.stderr)
        return True
    if result.exited != 0:
        said = (result.stderr.strip().splitlines() or ["no message"])[-1]
        print(notices.logs_failed(name, result.exited, said), file=sys.stderr)
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
                    print(notices.stream_ended(name), file=sys.stderr)
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
