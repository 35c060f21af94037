"""meshdeploy apply: converge the hosts to a cluster file, or to a plan saved by `plan -out`."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from meshdeploy import errors
from meshdeploy.commands import common, options
from meshdeploy.core.loading import load_cluster
from meshdeploy.core.plan import check_fresh, load_plan
from meshdeploy.engine import hosts as cluster_hosts
from meshdeploy.errors import AbortedError, PlanError
from meshdeploy.execute.interrupt import InterruptedApply
from meshdeploy.views import plan as view

NAME = "apply"
HELP = "converge the hosts to a cluster file or a saved plan"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE|PLANFILE")
    options.auto_approve(p)
    options.limit(p)
    p.add_argument("--json", action="store_true", help="machine-readable progress on stdout")
    options.host_keys(p)
    options.replace(p)
    options.target(p)
    options.purge(p, "hosts that left the file")
    options.lock_timeout(p)


@dataclass(frozen=True)
class Args(options.Arguments):
    file: str
    auto_approve: bool
    limit: list[str] | None
    json: bool
    accept_new_host_keys: bool
    replace: list[str] | None
    target: list[str] | None
    purge: bool
    lock_timeout: str | None


def run(args: Args) -> int:
    saved = load_plan(args.file) if _is_plan_file(args.file) else None
    if saved is not None:
        _refuse_new_addresses(args, saved)
    common.patch_for_gevent()
    if saved is not None:
        cluster = load_cluster(saved.cluster_path)
        limit = saved.limit or None  # a --limit beside it is refused unless the same
        replacing = saved.replace
        targets = saved.target
    else:
        cluster = load_cluster(args.file)
        limit = args.limit
        replacing = args.replace or ()
        targets = args.target or ()
    purge = saved.purge if saved is not None else args.purge
    if args.json and saved is None and not args.auto_approve:
        raise PlanError("apply --json cannot ask for confirmation",
                        hint="add --auto-approve, or apply a saved plan file")
    with common.Locked(cluster, "apply", args.lock_timeout) as lock:
        return _apply(args, cluster, saved, limit, (replacing, targets), purge, lock)


def _refuse_new_addresses(args: Args, saved) -> None:
    """A saved plan is applied as it was made: -target, -replace, --purge or another --limit
    beside it would apply something no plan showed, so they are refused rather than ignored."""
    given = [f"-target={a}" for a in args.target or ()] + [
        f"-replace={a}" for a in args.replace or ()] + (["--purge"] if args.purge else [])
    if args.limit and sorted(args.limit) != sorted(saved.limit):
        given.append(f"--limit {','.join(args.limit)}")
    if given:
        raise PlanError(f"apply {args.file}: {' '.join(given)} given with a saved plan, which "
                        "applies only what it planned",
                        hint="make the plan again with them (meshdeploy plan FILE ... -out "
                             "PLANFILE), or apply the cluster file with them")


def _is_plan_file(path: str) -> bool:
    """A saved plan is a JSON object with a format_version (save_plan); a cluster file, in YAML
    or in JSON, has none. A file that starts like JSON but does not parse is taken for a
    damaged plan only if it says format_version: load_plan then names what is wrong."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return False
    if not text.lstrip().startswith(b"{"):
        return False
    try:
        document = json.loads(text)
    except ValueError:  # also bad UTF-8
        return b'"format_version"' in text
    return isinstance(document, dict) and "format_version" in document


def _apply(args: Args, cluster, saved, limit, addresses, purge, lock) -> int:
    """addresses: the run's (-replace, -target) addresses."""
    from meshdeploy.engine.planner import config_hash, make_plan
    from meshdeploy.execute.apply import begin

    state, session = cluster_hosts.open_with_state(cluster, limit, args.accept_new_host_keys,
                                                   purge)
    try:
        lock.hosts(session)
        started = time.monotonic()
        planned = make_plan(session, addresses[0], purge, addresses[1])
        if saved is not None:
            check_fresh(saved, config_hash(cluster), planned.plan.fingerprints)
        elif not args.json:
            print(view.render_text(planned.plan, color=common.color()))
        begin(cluster, planned)
        if not planned.plan.has_changes():
            cluster_hosts.record_apply(state, cluster, session, planned, purge, True)
            if args.json:
                print(view.render_apply_json(planned.plan, [], time.monotonic() - started))
            elif saved is not None:
                print(view.NO_CHANGES)
            return errors.OK
        if saved is None and not args.auto_approve:
            if not common.confirm():
                raise AbortedError("apply cancelled: nothing was changed")
        if not args.json:
            print(view.render_running("Apply"))
        rows: list[dict] = []
        result = "failed"
        try:
            common.run_apply(session, planned, args.json, ran=rows)
            result = "complete"
        except InterruptedApply:
            result = "interrupted"
            raise
        finally:
            cluster_hosts.record_apply(state, cluster, session, planned, purge,
                                       result == "complete",
                                       last={"result": result, "steps": rows})
        elapsed = time.monotonic() - started
    finally:
        lock.release_hosts()
        session.close()
    if args.json:
        print(view.render_apply_json(planned.plan, rows, elapsed))
    else:
        print(view.render_done(rows, elapsed))
    return errors.OK
