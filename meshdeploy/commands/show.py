"""meshdeploy show: a saved plan (`plan -out FILE`), as text or JSON, without contacting any
host (Terraform's `show PLANFILE`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from meshdeploy import errors
from meshdeploy.commands import common, options
from meshdeploy.core.plan import load_plan
from meshdeploy.views import plan as view

NAME = "show"
HELP = "show a saved plan without contacting any host"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="PLANFILE", help="a plan saved with `plan -out PLANFILE`")
    p.add_argument("--json", action="store_true", help="the plan as JSON, as `plan --json`")


@dataclass(frozen=True)
class Args(options.Arguments):
    file: str
    json: bool


def run(args: Args) -> int:
    saved = load_plan(args.file)
    print(view.render_json(saved) if args.json else
          view.render_text(saved, color=common.color()))
    return errors.OK
