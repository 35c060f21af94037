"""meshdeploy plan: what apply would change on the hosts, as text or JSON, optionally saved."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from meshdeploy import errors
from meshdeploy.commands import common, options
from meshdeploy.core.loading import load_cluster
from meshdeploy.core.plan import save_plan
from meshdeploy.engine import hosts as cluster_hosts
from meshdeploy.views import plan as view

NAME = "plan"
HELP = "show what apply would change on the hosts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true", help="machine-readable plan on stdout")
    p.add_argument("-out", "--out", dest="out", metavar="FILE",
                   help="save the plan for a later `apply FILE`")
    p.add_argument("-detailed-exitcode", "--detailed-exitcode", dest="detailed_exitcode",
                   action="store_true",
                   help="exit 0 = no changes, 2 = changes, 1 = error")
    options.limit(p)
    options.host_keys(p)
    options.replace(p)
    options.target(p)
    options.purge(p, "hosts that left the file")


@dataclass(frozen=True)
class Args(options.Arguments):
    file: str
    json: bool
    out: str | None
    detailed_exitcode: bool
    limit: list[str] | None
    accept_new_host_keys: bool
    replace: list[str] | None
    target: list[str] | None
    purge: bool


def run(args: Args) -> int:
    common.patch_for_gevent()
    from meshdeploy.engine.planner import make_plan

    cluster = load_cluster(args.file)
    started = time.monotonic()
    # A host that cannot be reached is left out and named (its warning says what that means
    # for the servers): the plan of the others is still shown, and exits CONNECT.
    _, session = cluster_hosts.open_with_state(cluster, args.limit,
                                               args.accept_new_host_keys, args.purge,
                                               tolerate=True)
    session.leave_out_unreachable()
    try:
        planned = make_plan(session, args.replace or (), args.purge, args.target or ())
    finally:
        session.close()
    p = planned.plan
    p.remote_commands = dict(session.commands_run)
    p.seconds = round(time.monotonic() - started, 3)
    if args.json:
        print(view.render_json(p))
    else:
        print(view.render_text(p, color=common.color()))
    if session.unreachable:
        # Not saved: a plan to apply must be asked for with the hosts it covers named. The
        # plan's warnings name each host and what it means; --json's document is the plan.
        if args.json:
            return errors.CONNECT
        raise errors.ConnectError(
            "cannot connect over SSH to " + "; ".join(
                f"{n}: {why}" for n, why in sorted(session.unreachable.items()))
            + ("; the plan above covers the other hosts" + (f" and was not saved to {args.out}"
                                                          if args.out else "")),
            hint="bring the host back, or plan and apply without it: --limit "
                 + ",".join(h.name for h in session.hosts()))
    if args.out:
        save_plan(p, args.out)
        if not args.json:
            print(view.render_saved(args.out))
    if args.detailed_exitcode and p.has_changes():
        return errors.CHANGES
    return errors.OK
