"""meshdeploy destroy: remove everything meshdeploy put on the cluster's hosts."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from meshdeploy import errors
from meshdeploy.commands import common, options
from meshdeploy.core.loading import load_cluster
from meshdeploy.engine import hosts as cluster_hosts
from meshdeploy.engine import state as states
from meshdeploy.errors import AbortedError, PlanError
from meshdeploy.views import plan as view

NAME = "destroy"
HELP = "remove everything meshdeploy put on the cluster's hosts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE")
    p.add_argument("--json", action="store_true",
                   help="one JSON document at the end, as apply --json (needs --auto-approve)")
    options.auto_approve(p)
    options.limit(p)
    options.host_keys(p)
    options.purge(p, "every host")
    options.lock_timeout(p)


@dataclass(frozen=True)
class Args(options.Arguments):
    file: str
    json: bool
    auto_approve: bool
    limit: list[str] | None
    accept_new_host_keys: bool
    purge: bool
    lock_timeout: str | None


def run(args: Args) -> int:
    """Every host of the file (and the departed ones the state knows) loses what meshdeploy put
    there; builds, models and caches only with --purge. The toolchain's packages stay."""
    if args.json and not args.auto_approve:
        raise PlanError("destroy --json cannot ask for confirmation",
                        hint="add --auto-approve")
    common.patch_for_gevent()
    cluster = load_cluster(args.file)
    with common.Locked(cluster, "destroy", args.lock_timeout) as lock:
        return _destroy(args, cluster, lock)


def _destroy(args: Args, cluster, lock) -> int:
    from meshdeploy.engine.planner import make_destroy_plan

    state, session = cluster_hosts.open_with_state(cluster, args.limit,
                                                   args.accept_new_host_keys, purge=True)
    try:
        lock.hosts(session)
        started = time.monotonic()
        planned = make_destroy_plan(session, args.purge)
        if not args.json:
            print(view.render_text(planned.plan, color=common.color()))
        reached = [h.name for h in session.reached()]
        rows = []
        if planned.plan.has_changes():
            if not args.auto_approve and not common.confirm("destroy"):
                raise AbortedError("destroy cancelled: nothing was changed")
            if not args.json:
                print(view.render_running("Destroy"))
            ok = False
            try:
                rows = common.run_apply(session, planned, args.json, slots=False)
                ok = True
            finally:
                _forget(state, planned, reached, args.purge, ok)
            if not args.json:
                print(view.render_done(rows, time.monotonic() - started, "Destroy"))
        else:
            _forget(state, planned, reached, args.purge, True)
        if args.json:
            print(view.render_apply_json(planned.plan, rows, time.monotonic() - started))
    finally:
        lock.release_hosts()
        session.close()
    return errors.OK


def _forget(state, planned, reached, purge: bool, ok: bool) -> None:
    """Destroyed hosts leave the state (purged) or stay as retired (their bytes kept)."""
    done = planned.destroyed_hosts(reached)
    states.after_apply(state, None, [], {h: purge for h in done}, ok)
