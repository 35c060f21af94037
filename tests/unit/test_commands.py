"""Every command is one module of meshdeploy.commands with the same shape (NAME, HELP,
add_arguments, Args, run), the command line imports no pyinfra, gevent or fabric to build its
parser or to validate, and gevent's patch comes only from the runs that need it."""

from __future__ import annotations

import argparse
import dataclasses
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import meshdeploy.commands
from meshdeploy import cli, errors
from meshdeploy.commands import common

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("gevent", "pyinfra", "fabric", "paramiko", "invoke", "ssl")
LOCAL = "cluster: t\nllama_cpp: {ref: b11312}\nhosts:\n  here:\n    address: 127.0.0.1\n" \
        "    connection: local\n"


def subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in cli.build_parser()._actions
                  if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def minimal_argv(parser: argparse.ArgumentParser) -> list[str]:
    """The positionals a parser requires, each its first choice or a file name."""
    return [a.choices[0] if a.choices else "c.yaml" for a in parser._actions
            if not a.option_strings and a.nargs not in ("*", "?")]


def test_every_subcommand_is_one_command_module():
    names = set(subparsers()) - {"lab"}  # handed to meshdeploy.lab before parsing
    assert names == {c.NAME for c in cli.COMMANDS}
    for command in cli.COMMANDS:
        package, _, module = command.__name__.rpartition(".")
        assert package == "meshdeploy.commands"
        # exec_: `exec` is a builtin
        assert module.removesuffix("_") == command.NAME, command.__name__
        assert isinstance(command.HELP, str) and command.HELP
        assert callable(command.add_arguments) and callable(command.run)
        assert dataclasses.is_dataclass(command.Args)
        assert callable(command.Args.from_namespace)


def test_no_module_of_commands_is_a_command_the_parser_does_not_know():
    listed = {c.__name__ for c in cli.COMMANDS}
    for info in pkgutil.iter_modules(meshdeploy.commands.__path__, "meshdeploy.commands."):
        module = __import__(info.name, fromlist=["run"])
        if hasattr(module, "add_arguments") or hasattr(module, "NAME"):
            assert info.name in listed, f"{info.name} is not in cli.COMMANDS"


@pytest.mark.parametrize("command", cli.COMMANDS, ids=lambda c: c.NAME)
def test_args_hold_every_option_of_the_parser(command):
    parser = subparsers()[command.NAME]
    ns = parser.parse_args(minimal_argv(parser))
    args = command.Args.from_namespace(ns)
    fields = {f.name for f in dataclasses.fields(args)}
    # cli.py takes these
    assert fields == set(vars(ns)) - {"verbose", "debug", "no_color", "connect_timeout"}


PROBE = """
import sys
from meshdeploy import cli
heavy = {heavy!r}
code = cli.main(["validate", {file!r}])
assert code == 0, code
try:
    cli.main(["--help"])
except SystemExit:
    pass
for name in cli.COMMANDS:
    try:
        cli.main([name.NAME, "--help"])
    except SystemExit:
        pass
print("loaded:", sorted(m for m in heavy if m in sys.modules))
"""


def test_validate_and_help_load_no_pyinfra_gevent_or_fabric():
    """ssl too: gevent's patch warns when ssl was imported before it."""
    probe = PROBE.format(heavy=HEAVY, file=str(ROOT / "inventories" / "lab.yaml"))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "loaded: []", done.stdout


GEVENT_PROBE = """
import sys
from meshdeploy import cli
print("exec", cli.main(["exec", {file!r}, "--", "true"]))
print("logs", cli.main(["logs", {file!r}]))
from gevent import monkey
print("patched:", monkey.is_module_patched("socket"))
"""


def test_logs_and_exec_run_without_gevents_patch(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(LOCAL)
    done = subprocess.run([sys.executable, "-c", GEVENT_PROBE.format(file=str(path))],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "patched: False", done.stdout


class Loaded(Exception):
    """Stands in for loading the cluster file: the run stops there."""


@pytest.mark.parametrize("argv, patched", [
    (["plan", "c.yaml"], True), (["apply", "c.yaml"], True), (["destroy", "c.yaml"], True),
    (["status", "c.yaml"], True), (["state", "show", "c.yaml"], True),
    (["bench", "c.yaml"], True), (["logs", "c.yaml"], False),
    (["exec", "c.yaml", "--", "true"], False), (["validate", "c.yaml"], False)])
def test_the_runs_that_need_gevent_patch_first(argv, patched, monkeypatch):
    calls = []
    monkeypatch.setattr(common, "patch_for_gevent", lambda: calls.append("patch"))

    def load(path):
        calls.append("load")
        raise Loaded

    for command in cli.COMMANDS:
        if hasattr(command, "load_cluster"):
            monkeypatch.setattr(command, "load_cluster", load)
    assert cli.main(argv) == errors.ERROR
    assert calls == (["patch", "load"] if patched else ["load"])
