"""meshdeploy completion SHELL: the script that gives a shell TAB completion (argcomplete),
host names and resource addresses from the cluster file included."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from meshdeploy import errors
from meshdeploy.commands import options

NAME = "completion"
HELP = "print the shell's TAB completion script: eval \"$(meshdeploy completion bash)\""
SHELLS = ("bash", "zsh", "fish")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shell", choices=SHELLS)


@dataclass(frozen=True)
class Args(options.Arguments):
    shell: str


def run(args: Args) -> int:
    import argcomplete

    print(argcomplete.shellcode(["meshdeploy"], shell=args.shell), end="")
    return errors.OK
