"""Where the commands that reach the cluster's hosts begin: the hosts --limit keeps, and one
connected pyinfra Session; for plan, apply and destroy, first the state file (its access
checked against the file, the hosts it knows that the file no longer names)."""

from __future__ import annotations

from meshdeploy.engine import state as states
from meshdeploy.errors import PlanError
from meshdeploy.remote.session import Session


def limited(cluster, limit, departed=()) -> list[str]:
    """The names of the file's hosts that --limit `limit` keeps (every host without one), in
    file order; a name that is neither the file's nor a departed host's is one error."""
    if limit:
        known = {h.name for h in cluster.hosts} | {h.name for h in departed}
        unknown = [n for n in limit if n not in known]
        if unknown:
            raise PlanError(f"--limit names unknown host(s): {', '.join(unknown)}",
                            hint="hosts in the file: "
                                 f"{', '.join(h.name for h in cluster.hosts)}")
    return [h.name for h in cluster.hosts if not limit or h.name in limit]


def open_session(cluster, limit, accept_new_host_keys: bool, departed=(),
                 tolerate: bool = False) -> Session:
    """A connected Session to the file's hosts (only `limit`'s, when given) and the departed
    hosts the state knows that `limit` does not leave out. With `tolerate`, a host that cannot
    be reached is named in `session.unreachable` instead of failing the whole run (a refused
    host key still fails it)."""
    limited(cluster, limit, departed)
    # A departed host is destroyed unless --limit leaves it out.
    departed = [h for h in departed if not limit or h.name in limit]
    session = Session(cluster, limit, accept_new_host_keys=accept_new_host_keys,
                      departed=departed)
    session.open()
    session.connect(tolerate=tolerate)
    return session


def open_with_state(cluster, limit, accept_new_host_keys: bool, purge: bool,
                    tolerate: bool = False) -> tuple[states.State, Session]:
    """(the cluster's state, a connected Session) for plan, apply and destroy: the state's
    access must be the file's (`same_access`), and the hosts it knows that the file no longer
    names are reached too, to be destroyed (with their builds and models under `purge`)."""
    state = states.load(cluster)
    state.same_access(cluster, limit)
    return state, open_session(cluster, limit, accept_new_host_keys,
                               state.departed(cluster, purge), tolerate)


def record_apply(state: states.State, cluster, session: Session, planned, purge: bool,
                 ok: bool, last: dict | None = None) -> None:
    """The state after an apply (and after one that found nothing to change): the file's hosts
    the session covered, and the departed hosts the plan destroyed (purged with `purge`)."""
    departed = [h.name for h in session.departed]
    states.after_apply(state, cluster, session.hosts(),
                       {h: purge for h in planned.destroyed_hosts(departed)}, ok, last)
