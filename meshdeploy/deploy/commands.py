"""plan, apply and status as the CLI runs them (each returns an exit code)."""

from gevent import monkey

# pyinfra connects and gathers facts in greenlets: without the patch, hosts are served one at a
# time through the Python API (the pyinfra CLI does the same on import).
monkey.patch_all()

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from meshdeploy.deploy import errors  # noqa: E402
from meshdeploy.deploy.config import load_cluster  # noqa: E402
from meshdeploy.deploy.engine import config_hash, make_plan  # noqa: E402
from meshdeploy.deploy.session import Session  # noqa: E402
from meshdeploy.deploy.errors import AbortedError, PlanError  # noqa: E402
from meshdeploy.deploy.plan import check_fresh, load_plan, save_plan  # noqa: E402
from meshdeploy.deploy.render import render_apply_summary, render_json, render_text  # noqa: E402


def _session(cluster, limit):
    if limit:
        unknown = [n for n in limit if n not in {h.name for h in cluster.hosts}]
        if unknown:
            raise PlanError(f"--limit names unknown host(s): {', '.join(unknown)}",
                            hint="use host names from the cluster file")
    session = Session(cluster, limit)
    session.open()
    session.connect()
    return session


def _color() -> bool:
    return sys.stdout.isatty()


def plan(args) -> int:
    cluster = load_cluster(args.file)
    started = time.monotonic()
    session = _session(cluster, args.limit)
    try:
        planned = make_plan(session)
    finally:
        session.close()
    elapsed = time.monotonic() - started
    p = planned.plan
    p.remote_commands = dict(session.commands_run)
    p.seconds = round(elapsed, 3)
    if args.json:
        print(render_json(p))
    else:
        print(render_text(p, color=_color()))
    if args.out:
        save_plan(p, args.out)
        if not args.json:
            print(f"\nSaved the plan to {args.out}. Apply exactly it with: "
                  f"meshdeploy apply {args.out}")
    if args.detailed_exitcode and p.has_changes():
        return errors.CHANGES
    return errors.OK


def _is_plan_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
    except OSError:
        return False
    return head.startswith(b"{")


def apply(args) -> int:
    from meshdeploy.deploy.apply import apply as run_apply
    from meshdeploy.deploy.apply import begin

    saved = None
    if _is_plan_file(args.file):
        saved = load_plan(args.file)
        cluster = load_cluster(saved.cluster_path)
        limit = saved.limit or args.limit
    else:
        cluster = load_cluster(args.file)
        limit = args.limit
    session = _session(cluster, limit)
    try:
        started = time.monotonic()
        planned = make_plan(session)
        if saved is not None:
            check_fresh(saved, config_hash(cluster), planned.plan.fingerprints)
        else:
            print(render_text(planned.plan, color=_color()))
        begin(cluster, planned)
        if not planned.plan.has_changes():
            if saved is not None:
                print("No changes. The cluster matches the configuration.")
            return errors.OK
        if saved is None and not args.auto_approve:
            if not _confirm():
                raise AbortedError("apply cancelled: nothing was changed")
        print("\nApplying:")
        rows = run_apply(session, planned, progress=print)
        elapsed = time.monotonic() - started
    finally:
        session.close()
    print()
    print(render_apply_summary(rows))
    print(f"\nApply complete in {elapsed:.1f} s.")
    return errors.OK


def _confirm() -> bool:
    if not sys.stdin.isatty():
        raise AbortedError("apply needs confirmation, and stdin is not a terminal",
                           hint="rerun with --auto-approve, or apply a saved plan file")
    print("\nDo you want to perform these actions? Only 'yes' will be accepted.")
    try:
        return input("  Enter a value: ").strip() == "yes"
    except EOFError:
        return False


def status(args) -> int:
    from meshdeploy.deploy.status import collect, render

    cluster = load_cluster(args.file)
    session = _session(cluster, None)
    try:
        rows = collect(session)
    finally:
        session.close()
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    else:
        print(render(rows))
    healthy = all(r["healthy"] for r in rows)
    return errors.OK if healthy else errors.ERROR


