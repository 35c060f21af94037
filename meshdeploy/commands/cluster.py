"""plan, apply and status as the CLI runs them (each returns an exit code)."""

from gevent import monkey

# pyinfra connects and gathers facts in greenlets: without the patch, hosts are served one at a
# time through the Python API (the pyinfra CLI does the same on import).
monkey.patch_all()

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from meshdeploy import errors  # noqa: E402
from meshdeploy.config.load import load_cluster  # noqa: E402
from meshdeploy.core.plan import check_fresh, load_plan, save_plan  # noqa: E402
from meshdeploy.engine import locks  # noqa: E402
from meshdeploy.engine import state as states  # noqa: E402
from meshdeploy.engine.planner import config_hash, make_plan  # noqa: E402
from meshdeploy.errors import AbortedError, PlanError  # noqa: E402
from meshdeploy.execute.interrupt import InterruptedApply  # noqa: E402
from meshdeploy.remote.session import Session  # noqa: E402
from meshdeploy.views.plan import (  # noqa: E402
    render_apply_json,
    render_apply_summary,
    render_json,
    render_text,
)


def _session(cluster, limit, args, departed=()):
    if limit:
        known = {h.name for h in cluster.hosts} | {h.name for h in departed}
        unknown = [n for n in limit if n not in known]
        if unknown:
            raise PlanError(f"--limit names unknown host(s): {', '.join(unknown)}",
                            hint="use host names from the cluster file")
    # A departed host is destroyed unless --limit leaves it out.
    departed = [h for h in departed if not limit or h.name in limit]
    session = Session(cluster, limit,
                      accept_new_host_keys=getattr(args, "accept_new_host_keys", False),
                      departed=departed)
    session.open()
    session.connect()
    return session


def _color() -> bool:
    return sys.stdout.isatty()


def plan(args) -> int:
    cluster = load_cluster(args.file)
    started = time.monotonic()
    purge = getattr(args, "purge", False)
    session = _session(cluster, args.limit, args, states.load(cluster).departed(cluster, purge))
    try:
        planned = make_plan(session, args.replace or (), purge)
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
    saved = None
    if _is_plan_file(args.file):
        saved = load_plan(args.file)
        cluster = load_cluster(saved.cluster_path)
        limit = saved.limit or args.limit
        replacing = saved.replace
    else:
        cluster = load_cluster(args.file)
        limit = args.limit
        replacing = args.replace or ()
    purge = saved.purge if saved is not None else args.purge
    if getattr(args, "json", False) and saved is None and not args.auto_approve:
        raise PlanError("apply --json cannot ask for confirmation",
                        hint="add --auto-approve, or apply a saved plan file")
    with Locked(cluster, args, "apply") as lock:
        return _apply(args, cluster, saved, limit, replacing, purge, lock)


def _run_apply(session, planned, json_output: bool = False, **kwargs) -> list[dict]:
    """apply.apply with live progress: a line per host on a terminal, plain lines in a pipe,
    none with --json (progress_view)."""
    from meshdeploy.execute.apply import apply as run_apply
    from meshdeploy.views.progress import reporter

    with reporter([h.name for h in session.reached()], json_output) as live:
        session.listener = live.line
        try:
            return run_apply(session, planned, progress=None if json_output else print,
                             reporter=live, **kwargs)
        finally:
            session.listener = None


def _apply(args, cluster, saved, limit, replacing, purge, lock) -> int:
    from meshdeploy.execute.apply import begin

    as_json = getattr(args, "json", False)
    state = states.load(cluster)
    session = _session(cluster, limit, args, state.departed(cluster, purge))
    try:
        lock.hosts(session)
        started = time.monotonic()
        planned = make_plan(session, replacing, purge)
        if saved is not None:
            check_fresh(saved, config_hash(cluster), planned.plan.fingerprints)
        elif not as_json:
            print(render_text(planned.plan, color=_color()))
        begin(cluster, planned)
        if not planned.plan.has_changes():
            departed = [h.name for h in session.departed]
            states.after_apply(state, cluster, session.hosts(),
                               {h: purge for h in planned.destroyed_hosts(departed)}, True)
            if as_json:
                print(render_apply_json(planned.plan, [], time.monotonic() - started))
            elif saved is not None:
                print("No changes. The cluster matches the configuration.")
            return errors.OK
        if saved is None and not args.auto_approve:
            if not _confirm():
                raise AbortedError("apply cancelled: nothing was changed")
        if not as_json:
            print("\nApplying:")
        rows: list[dict] = []
        result = "failed"
        try:
            _run_apply(session, planned, as_json, ran=rows)
            result = "complete"
        except InterruptedApply:
            result = "interrupted"
            raise
        finally:
            departed = [h.name for h in session.departed]
            states.after_apply(state, cluster, session.hosts(),
                               {h: purge for h in planned.destroyed_hosts(departed)},
                               result == "complete", last={"result": result, "steps": rows})
        elapsed = time.monotonic() - started
    finally:
        lock.release_hosts()
        session.close()
    if as_json:
        print(render_apply_json(planned.plan, rows, elapsed))
        return errors.OK
    print()
    print(render_apply_summary(rows))
    print(f"\nApply complete in {elapsed:.1f} s.")
    return errors.OK


def destroy(args) -> int:
    """Every host of the file (and the departed ones the state knows) loses what meshdeploy put
    there; builds, models and caches only with --purge. The toolchain's packages stay."""
    cluster = load_cluster(args.file)
    with Locked(cluster, args, "destroy") as lock:
        return _destroy(args, cluster, lock)


def _destroy(args, cluster, lock) -> int:
    from meshdeploy.engine.planner import make_destroy_plan

    state = states.load(cluster)
    session = _session(cluster, args.limit, args, state.departed(cluster, purge=True))
    try:
        lock.hosts(session)
        started = time.monotonic()
        planned = make_destroy_plan(session, args.purge)
        print(render_text(planned.plan, color=_color()))
        reached = [h.name for h in session.reached()]
        if planned.plan.has_changes():
            if not args.auto_approve and not _confirm("destroy"):
                raise AbortedError("destroy cancelled: nothing was changed")
            print("\nDestroying:")
            ok = False
            try:
                rows = _run_apply(session, planned, slots=False)
                ok = True
            finally:
                _forget(state, planned, reached, args.purge, ok)
            print()
            print(render_apply_summary(rows))
            print(f"\nDestroy complete in {time.monotonic() - started:.1f} s.")
        else:
            _forget(state, planned, reached, args.purge, True)
    finally:
        lock.release_hosts()
        session.close()
    return errors.OK


class Locked:
    """The control machine's lock for the whole run, and the hosts' once connected."""

    def __init__(self, cluster, args, command: str):
        self.holder = locks.me(command)
        self.timeout = locks.duration(getattr(args, "lock_timeout", None) or "0")
        self.control = locks.ControlLock(cluster.path, self.holder, self.timeout)
        self.on_hosts = None

    def __enter__(self):
        self.control.acquire()
        return self

    def hosts(self, session) -> None:
        self.on_hosts = locks.HostLocks(session, self.holder, self.timeout).__enter__()

    def release_hosts(self) -> None:
        if self.on_hosts is not None:
            self.on_hosts.release()
            self.on_hosts = None

    def __exit__(self, *exc):
        self.release_hosts()
        self.control.release()


def _forget(state, planned, reached, purge: bool, ok: bool) -> None:
    """Destroyed hosts leave the state (purged) or stay as retired (their bytes kept)."""
    done = planned.destroyed_hosts(reached)
    states.after_apply(state, None, [], {h: purge for h in done}, ok)


def _confirm(what: str = "apply") -> bool:
    if not sys.stdin.isatty():
        raise AbortedError(f"{what} needs confirmation, and stdin is not a terminal",
                           hint="rerun with --auto-approve" +
                                (", or apply a saved plan file" if what == "apply" else ""))
    print("\nDo you want to perform these actions? Only 'yes' will be accepted.")
    try:
        return input("  Enter a value: ").strip() == "yes"
    except EOFError:
        return False


def status(args) -> int:
    from meshdeploy.commands.status import collect, render

    cluster = load_cluster(args.file)
    session = _session(cluster, None, args)
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




def bench(args) -> int:
    from meshdeploy.commands.bench import run

    return run(args)


def state(args) -> int:
    """`state show FILE`: the state as JSON. `state rebuild FILE`: the state made again from
    the file's hosts: a host is recorded when the probe finds anything of meshdeploy's on it
    (what `destroy --purge` would remove: units, the nftables table, a tunnel, builds, models,
    caches). A host that already left the file cannot be found this way."""
    from meshdeploy.engine.planner import make_destroy_plan

    cluster = load_cluster(args.file)
    if args.action == "show":
        print(json.dumps(states.load(cluster).to_dict(), indent=2, sort_keys=True))
        return errors.OK
    with Locked(cluster, args, "state rebuild") as lock:
        session = _session(cluster, None, args)
        try:
            lock.hosts(session)
            planned = make_destroy_plan(session, purge=True)
        finally:
            lock.release_hosts()
            session.close()
    fresh = states.State(path=states.state_path(cluster.path), cluster=cluster.name)
    for host in cluster.hosts:
        found = sorted({f"{c.role}.{c.resource}" for c in planned.plan.changes
                        if c.host == host.name})
        if found:
            fresh.hosts[host.name] = states.record_for(cluster, host)
        print(f"{host.name}: " + (", ".join(found) if found else "nothing of meshdeploy's"))
    states.save(fresh)
    print(f"\nWrote {fresh.path} ({len(fresh.hosts)} of {len(cluster.hosts)} hosts).")
    return errors.OK
