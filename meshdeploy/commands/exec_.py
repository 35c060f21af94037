"""meshdeploy exec: one command on the hosts in parallel, its output grouped per host.

The module is exec_ because `exec` is a Python builtin: `from meshdeploy.commands import exec`
would hide it. fabric runs each host in a real thread: nothing here patches for gevent, and
remote.connections (fabric) is imported in `run`, not when the parser is built.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from meshdeploy import errors
from meshdeploy.commands import common, options
from meshdeploy.core.loading import load_cluster
from meshdeploy.core import shell
from meshdeploy.engine import hosts as cluster_hosts
from meshdeploy.views.exec_ import HostRun, render_text

NAME = "exec"
HELP = "run a command on the hosts in parallel, output grouped per host"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "meshdeploy exec FILE [--limit HOST,...] [--sudo] -- CMD [ARG...]"
    p.add_argument("file", metavar="FILE")
    p.set_defaults(argv=[])  # the words after `--` (cli.main): one word is a shell snippet run
    # by sh as written ('echo $HOME | wc -c'); several words are one command, each passed literally
    options.limit(p)
    p.add_argument("--sudo", action="store_true", help="run it as root (sudo -n: never a "
                                                       "password prompt)")
    options.host_keys(p)
    p.epilog = ("CMD after --: one word is a shell snippet run by sh as written ('echo $HOME | "
                "wc -c'); several words are one command, each word passed literally (quoted). "
                "Exit 0 when it exited 0 everywhere, 1 when it failed on some host, 4 when a "
                "host could not be reached.")


@dataclass(frozen=True)
class Args(options.Arguments):
    file: str
    argv: list[str]
    limit: list[str] | None
    sudo: bool
    accept_new_host_keys: bool


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


def run(args: Args) -> int:
    from meshdeploy.remote import connections as remote

    cluster = load_cluster(args.file)
    names = cluster_hosts.limited(cluster, args.limit)
    text = command_text(args.argv)
    rootless = [n for n in names if cluster.host(n).rootless]
    if args.sudo and rootless:
        raise errors.MeshdeployError(f"--sudo: {', '.join(rootless)} "
                                     f"{'is' if len(rootless) == 1 else 'are'} rootless: "
                                     "nothing runs as root there",
                                     hint="leave those hosts out with --limit, or drop --sudo")
    # stderr joins stdout so each host's output reads in the order it was written. --sudo on
    # the local host is sudo only when meshdeploy does not run as root (it may have no sudo).
    commands = {n: remote.as_root(text, args.sudo and (cluster.host(n).sudo
                                                      or not cluster.host(n).local)) + " 2>&1"
                for n in names}
    hosts = common.open_hosts(cluster, names, args.accept_new_host_keys)
    try:
        results = remote.each(hosts, lambda name, conn: conn.run(
            commands[name], warn=True, hide=True, in_stream=False))
        by_name = {n: (hosts.connections[n], r) for n, r in results.items()}
    finally:
        hosts.close()
    runs = []
    for name in names:
        if name in hosts.unreachable:
            runs.append(HostRun(name, None, unreachable=hosts.unreachable[name]))
            continue
        conn, result = by_name[name]
        if isinstance(result, Exception):
            runs.append(HostRun(name, None, unreachable=remote.reason(result)))
        else:
            runs.append(HostRun(name, result.exited, conn.seconds, result.stdout))
    print(render_text(runs))
    return exit_code(["unreachable" if r.exited is None else r.exited for r in runs])


def exit_code(exits: list) -> int:
    """exec's exit: 4 when a host was unreachable, else 1 when the command failed anywhere."""
    if "unreachable" in exits:
        return errors.CONNECT
    return errors.ERROR if any(e != 0 for e in exits) else errors.OK
