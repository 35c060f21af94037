"""meshdeploy resources: every resource meshdeploy manages, in apply order."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from meshdeploy import errors
from meshdeploy.commands import options
from meshdeploy.core import registry
from meshdeploy.views import resources as view

NAME = "resources"
HELP = "list every resource meshdeploy manages, in apply order"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--markdown", action="store_true", help="a Markdown table")


@dataclass(frozen=True)
class Args(options.Arguments):
    markdown: bool


def run(args: Args) -> int:
    """The registry as a table: what `plan` and `apply` go through, and where each lives."""
    print(view.render_text(registry.resources(), markdown=args.markdown))
    return errors.OK
