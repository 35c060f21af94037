"""The `meshdeploy` command line: argument parsing, error reporting and exit codes.

Each command is one module of meshdeploy.commands (COMMANDS): its NAME and HELP, its options
(`add_arguments`), its typed arguments (`Args.from_namespace`) and its entry (`run`). This module
builds the parser from them, hands the chosen one its Args, and guarantees that users see one
clear message and a documented exit code, never a traceback unless they ask for one with --debug.
Importing the command modules loads the cluster file's reader (jsonschema, ruamel), not pyinfra,
gevent or fabric: the runs that need those import them, so --help and validate never do.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable

from meshdeploy import errors
from meshdeploy.commands import (
    apply,
    bench,
    completion,
    destroy,
    exec_,
    logs,
    plan,
    prometheus,
    resources,
    show,
    state,
    status,
    validate,
)
from meshdeploy.commands import options
from meshdeploy.errors import MeshdeployError
from meshdeploy.remote.ssh_settings import CONNECT_TIMEOUT_ENV
from meshdeploy.views import diagnostics

# In the order --help lists them.
COMMANDS = (validate, plan, show, apply, destroy, status, logs, exec_, bench, prometheus, state,
            resources, completion)
_BY_NAME = {command.NAME: command for command in COMMANDS}


class Parser(argparse.ArgumentParser):
    """argparse exits 2 on usage errors, which --detailed-exitcode reserves for "changes"."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(errors.ERROR, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="meshdeploy",
        description="Plan and apply llama.cpp RPC inference clusters from a cluster file.",
        epilog="meshdeploy lab ... manages the local systemd-nspawn lab (meshdeploy lab --help).")
    parser.add_argument("--version", action="version", version=f"meshdeploy {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                parser_class=Parser)
    parser.commands = {}
    for command in COMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP, description=command.HELP)
        p.add_argument("--verbose", "-v", action="store_true",
                       help="show every error, not only the most relevant one")
        p.add_argument("--debug", action="store_true", help="show tracebacks")
        p.add_argument("-no-color", "--no-color", dest="no_color", action="store_true",
                       help="no colour in the output (so does NO_COLOR set to anything)")
        p.add_argument("--connect-timeout", type=options.connect_timeout, metavar="SECONDS",
                       help="give up on a host whose SSH connection (TCP connect and SSH "
                            "banner) takes longer, in every command (default: the host's "
                            "ssh_config ConnectTimeout, else 10)")
        command.add_arguments(p)
        parser.commands[command.NAME] = p
    sub.add_parser("lab", help="manage the local systemd-nspawn lab", add_help=False)
    return parser


def version() -> str:
    """The installed distribution's version (pyproject.toml's)."""
    from importlib import metadata

    try:
        return metadata.version("meshdeploy")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `meshdeploy plan --json | head`: the reader left, nothing to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's flush at exit must not fail again
        return errors.ERROR


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lab"]:
        return run_lab(argv[1:])
    words = None
    if argv[:1] == [exec_.NAME] and "--" in argv:  # everything after `--` is the remote command
        cut = argv.index("--")
        argv, words = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions (meshdeploy completion)
        import argcomplete

        argcomplete.autocomplete(parser)  # answers and exits
    ns, extra = parser.parse_known_args(argv)
    if words is not None:
        ns.argv = words
    # argparse gives a `*` positional only the words before the first option: `logs FILE -n 5
    # node2` names node2 too.
    if extra and ns.command == logs.NAME and not any(e.startswith("-") for e in extra):
        ns.targets += extra
    elif extra:  # the usage shown is the command's own, as for every other usage error
        parser.commands[ns.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if ns.no_color:  # https://no-color.org: what the views (and any child) read
        os.environ["NO_COLOR"] = "1"
    if ns.connect_timeout is not None:  # what remote.ssh_settings reads for every host
        os.environ[CONNECT_TIMEOUT_ENV] = f"{ns.connect_timeout:g}"
    command = _BY_NAME[ns.command]
    detailed = command is plan and ns.detailed_exitcode
    return guarded(lambda: command.run(command.Args.from_namespace(ns)), debug=ns.debug,
                   verbose=ns.verbose, detailed=detailed, as_json=getattr(ns, "json", False))


def run_lab(rest: list[str]) -> int:
    def work() -> int:
        from meshdeploy.lab.cli import main as lab_main

        return lab_main(rest)

    return guarded(work, debug="--debug" in rest, verbose=False)


def guarded(work: Callable[[], int | None], debug: bool, verbose: bool,
            detailed: bool = False, as_json: bool = False) -> int:
    """work()'s exit code; an error as one message on stderr and its exit code (1 for every
    error with `detailed`, plan's --detailed-exitcode); with `as_json` (the command's --json)
    the error is JSON diagnostics on stdout instead (views.diagnostics), same exit code."""
    try:
        code = work()
        return errors.OK if code is None else int(code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return errors.INTERRUPTED
    except MeshdeployError as exc:
        if debug:
            traceback.print_exc()
        # Terraform's convention: with --detailed-exitcode, 2 means "changes", so errors
        # collapse to 1 and cannot be mistaken for it.
        code = errors.ERROR if detailed else exc.exit_code
        if as_json:
            print(diagnostics.render_error(exc, code))
        else:
            # An apply's error quotes what hosts printed: shown, never run by the terminal.
            print(errors.terminal_text(exc.render(verbose=verbose)), file=sys.stderr)
        return code
    except Exception as exc:  # the last line of defence: no traceback unless asked
        if debug:
            traceback.print_exc()
        elif as_json:
            print(diagnostics.render_error(exc, errors.ERROR))
        else:
            print(errors.terminal_text(f"internal error: {type(exc).__name__}: {exc}\n"
                                       "rerun with --debug for the traceback, and report it"),
                  file=sys.stderr)
        return errors.ERROR
