"""meshdeploy validate: the cluster file checked, without contacting any host."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from meshdeploy import errors
from meshdeploy.commands import options
from meshdeploy.core import loading
from meshdeploy.core.loading import load_cluster
from meshdeploy.errors import ConfigError
from meshdeploy.views import diagnostics, notices
from meshdeploy.views import validate as view

NAME = "validate"
HELP = "check a cluster file without contacting any host"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true",
                   help="diagnostics as JSON on stdout (Terraform's validate -json shape)")


@dataclass(frozen=True)
class Args(options.Arguments):
    file: str
    json: bool


def run(args: Args) -> int:
    try:
        cluster = load_cluster(args.file)
    except ConfigError as error:  # every error, in file order: the others show the first
        if args.json:
            print(diagnostics.render_error(error, error.exit_code))
        else:
            print(errors.terminal_text(view.render_errors(error)), file=sys.stderr)
        return error.exit_code
    warnings = loading.warnings(cluster)
    if args.json:
        print(diagnostics.render_valid(warnings, **view.summary(cluster)))
        return errors.OK
    for warning in warnings:
        print(notices.warning(warning), file=sys.stderr)
    print(view.render_text(args.file, cluster))
    return errors.OK
