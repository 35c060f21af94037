"""The `meshdeploy` command line: argument parsing, error reporting and exit codes.

Work is done elsewhere (config loading here for validate, meshdeploy.commands.cluster for the
rest); this module only guarantees that users see one clear message and a documented exit
code, never a traceback unless they ask for one with --debug.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Callable

from meshdeploy import errors
from meshdeploy.errors import MeshdeployError


class Parser(argparse.ArgumentParser):
    """argparse exits 2 on usage errors, which --detailed-exitcode reserves for "changes"."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(errors.ERROR, f"{self.prog}: error: {message}\n")


def host_list(value: str) -> list[str]:
    hosts = [h.strip() for h in value.split(",") if h.strip()]
    if not hosts:
        raise argparse.ArgumentTypeError("expected HOST[,HOST...]")
    return hosts


def replace_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("-replace", "--replace", action="append", metavar="ADDRESS",
                   help="replace this resource even if it matches (repeatable; Terraform's "
                        "spelling: -replace=network.wireguard rotates every host's WireGuard "
                        "keys, -replace=node2/network.wireguard one host's)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="meshdeploy",
        description="Plan and apply llama.cpp RPC inference clusters from a cluster file.",
        epilog="meshdeploy lab ... manages the local systemd-nspawn lab (meshdeploy lab --help).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=Parser)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--verbose", "-v", action="store_true",
                       help="show every error, not only the most relevant one")
        p.add_argument("--debug", action="store_true", help="show tracebacks")
        return p

    def host_keys(p: argparse.ArgumentParser) -> None:
        p.add_argument("--accept-new-host-keys", action="store_true",
                       help="record the key of a host not yet in known_hosts (first contact); "
                            "a changed key is still refused")

    def lock_option(p: argparse.ArgumentParser) -> None:
        p.add_argument("-lock-timeout", "--lock-timeout", dest="lock_timeout", metavar="DURATION",
                       help="wait this long for another apply or destroy to release the "
                            "cluster's lock (30s, 5m; default 0: fail at once, naming it)")

    def purge_option(p: argparse.ArgumentParser, who: str) -> None:
        p.add_argument("--purge", action="store_true",
                       help=f"also remove the llama.cpp builds, models and rpc-server caches of "
                            f"{who} (kept otherwise: their bytes are expensive); the toolchain's "
                            "packages always stay")

    p = command("validate", "check a cluster file without contacting any host")
    p.add_argument("file", metavar="FILE")
    p.set_defaults(handler=validate)

    p = command("plan", "show what apply would change on the hosts")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help="machine-readable plan on stdout")
    p.add_argument("-out", "--out", dest="out", metavar="FILE",
                   help="save the plan for a later `apply FILE`")
    p.add_argument("--detailed-exitcode", action="store_true",
                   help="exit 0 = no changes, 2 = changes, 1 = error")
    p.add_argument("--limit", type=host_list, metavar="HOST,...", help="only these hosts")
    host_keys(p)
    replace_option(p)
    purge_option(p, "hosts that left the file")
    p.set_defaults(handler=engine("plan"))

    p = command("apply", "converge the hosts to a cluster file or a saved plan")
    p.add_argument("file", metavar="FILE|PLANFILE")
    p.add_argument("--auto-approve", action="store_true", help="do not ask for confirmation")
    p.add_argument("--limit", type=host_list, metavar="HOST,...", help="only these hosts")
    p.add_argument("--json", action="store_true", help="machine-readable progress on stdout")
    host_keys(p)
    replace_option(p)
    purge_option(p, "hosts that left the file")
    lock_option(p)
    p.set_defaults(handler=engine("apply"))

    p = command("destroy", "remove everything meshdeploy put on the cluster's hosts")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--auto-approve", action="store_true", help="do not ask for confirmation")
    p.add_argument("--limit", type=host_list, metavar="HOST,...", help="only these hosts")
    host_keys(p)
    purge_option(p, "every host")
    lock_option(p)
    p.set_defaults(handler=engine("destroy"))

    p = command("status", "show what runs on the hosts and whether it is healthy")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help="machine-readable status on stdout")
    host_keys(p)
    p.set_defaults(handler=engine("status"))

    p = command("logs", "the services' logs from every host, merged by time")
    p.add_argument("file", metavar="FILE")
    p.add_argument("targets", nargs="*", metavar="HOST|SERVICE",
                   help="only these: host names, rpc-server, llama-server, a server name, a unit "
                        "name or an rpc-server's host:port (default: every service)")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing new lines as they come, until Ctrl-C (exit 0)")
    p.add_argument("--since", metavar="WHEN", help="only lines since 10m, 2h, 1d ago or a date "
                                                   "(YYYY-MM-DD [HH:MM[:SS]])")
    p.add_argument("-n", "--lines", type=int, metavar="N",
                   help="the last N lines of each service (default 10; all with --since)")
    host_keys(p)
    p.epilog = ("A host that cannot be reached is named on stderr and the others are shown; the "
                "exit code is 4 only when no host could be read.")
    p.set_defaults(handler=adhoc("logs"))

    p = command("exec", "run a command on the hosts in parallel, output grouped per host")
    p.usage = "meshdeploy exec FILE [--limit HOST,...] [--sudo] -- CMD [ARG...]"
    p.add_argument("file", metavar="FILE")
    p.set_defaults(argv=[])  # the words after `--` (main): one word is a shell snippet run by
    # sh as written ('echo $HOME | wc -c'); several words are one command, each passed literally
    p.add_argument("--limit", type=host_list, metavar="HOST,...", help="only these hosts")
    p.add_argument("--sudo", action="store_true", help="run it as root (sudo -n: never a "
                                                       "password prompt)")
    host_keys(p)
    p.epilog = ("CMD after --: one word is a shell snippet run by sh as written ('echo $HOME | "
                "wc -c'); several words are one command, each word passed literally (quoted). "
                "Exit 0 when it exited 0 everywhere, 1 when it failed on some host, 4 when a "
                "host could not be reached.")
    p.set_defaults(handler=adhoc("run_exec"))

    p = command("bench", "tokens/s of the deployed llama-servers, from their own timings")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--server", metavar="NAME", help="only this server (default: every server)")
    p.add_argument("--runs", type=int, default=3, metavar="N",
                   help="measured runs over the prompt set, after one warm-up (default 3)")
    p.add_argument("--compare-local", action="store_true",
                   help="also run the same build and model on the orchestrator alone, when it "
                        "fits, and show cluster/local")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    host_keys(p)
    p.set_defaults(handler=engine("bench"))

    p = command("state", "show the state file, or make it again from the hosts")
    p.add_argument("action", choices=("show", "rebuild"))
    p.add_argument("file", metavar="FILE")
    host_keys(p)
    lock_option(p)
    p.set_defaults(handler=engine("state"))

    p = command("resources", "list every resource meshdeploy manages, in apply order")
    p.add_argument("--markdown", action="store_true", help="a Markdown table")
    p.set_defaults(handler=resources)

    sub.add_parser("lab", help="manage the local systemd-nspawn lab", add_help=False)
    return parser


def resources(args: argparse.Namespace) -> int:
    """The registry as a table: what `plan` and `apply` go through, and where each lives."""
    from tabulate import tabulate

    from meshdeploy.core import registry

    rows = [[r.qualified, f"roles/{r.role}",
             "per key" if r.keys else "per host",
             r.doc + (" (apply only)" if r.apply_only else "")]
            for r in registry.resources()]
    print(tabulate(rows, headers=["resource", "code", "instances", "what it manages"],
                   tablefmt="github" if args.markdown else "simple"))
    return errors.OK


def engine(name: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        # Imported late: the engine pulls in pyinfra, which validate and --help do not need.
        from meshdeploy.commands import cluster as commands

        return getattr(commands, name)(args)

    handler.__name__ = name
    return handler


def adhoc(name: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        # fabric in real threads: not the gevent-patched commands module of plan and apply.
        from meshdeploy.commands import adhoc as commands

        return getattr(commands, name)(args)

    handler.__name__ = name
    return handler


def validate(args: argparse.Namespace) -> int:
    from meshdeploy.config.checks import warnings_for
    from meshdeploy.config.load import load_cluster

    cluster = load_cluster(args.file)
    for warning in warnings_for(cluster):
        print(f"warning: {warning}", file=sys.stderr)
    rpc_servers = len(cluster.rpc_servers())
    print(f"{args.file}: ok ({plural(len(cluster.hosts), 'host')}, "
          f"{plural(rpc_servers, 'rpc-server')}, {plural(len(cluster.models), 'model')})")
    return errors.OK


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lab"]:
        return run_lab(argv[1:])
    words = None
    if argv[:1] == ["exec"] and "--" in argv:  # everything after `--` is the remote command
        cut = argv.index("--")
        argv, words = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if words is not None:
        args.argv = words
    # argparse gives a `*` positional only the words before the first option: `logs FILE -n 5
    # node2` names node2 too.
    if extra and isinstance(getattr(args, "targets", None), list) \
            and not any(e.startswith("-") for e in extra):
        args.targets += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return run(args.handler, args)


def run_lab(rest: list[str]) -> int:
    debug = "--debug" in rest

    def handler(_args: argparse.Namespace) -> int:
        from meshdeploy.lab.cli import main as lab_main

        return lab_main(rest)

    return run(handler, argparse.Namespace(debug=debug, verbose=False))


def run(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    detailed = getattr(args, "detailed_exitcode", False)
    try:
        code = handler(args)
        return errors.OK if code is None else int(code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return errors.INTERRUPTED
    except MeshdeployError as exc:
        if args.debug:
            traceback.print_exc()
        # An apply's error quotes what hosts printed: shown, never run by the terminal.
        print(errors.terminal_text(exc.render(verbose=args.verbose)), file=sys.stderr)
        # Terraform's convention: with --detailed-exitcode, 2 means "changes", so errors
        # collapse to 1 and cannot be mistaken for it.
        return errors.ERROR if detailed else exc.exit_code
    except Exception as exc:  # the last line of defence: no traceback unless asked
        if args.debug:
            traceback.print_exc()
        else:
            print(errors.terminal_text(f"internal error: {type(exc).__name__}: {exc}\n"
                                       "rerun with --debug for the traceback, and report it"),
                  file=sys.stderr)
        return errors.ERROR
