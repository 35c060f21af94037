"""meshdeploy state: show the state file, or make it again from the hosts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from meshdeploy import errors
from meshdeploy.commands import common, options
from meshdeploy.core.loading import load_cluster
from meshdeploy.engine import hosts as cluster_hosts
from meshdeploy.engine import state as states
from meshdeploy.views import state as view

NAME = "state"
HELP = "show the state file, or make it again from the hosts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("show", "rebuild"))
    p.add_argument("file", metavar="FILE")
    options.host_keys(p)
    options.lock_timeout(p)


@dataclass(frozen=True)
class Args(options.Arguments):
    action: str
    file: str
    accept_new_host_keys: bool
    lock_timeout: str | None


def run(args: Args) -> int:
    """`state show FILE`: the state as JSON. `state rebuild FILE`: the state made again from
    the file's hosts: a host is recorded when the probe finds anything of meshdeploy's on it
    (what `destroy --purge` would remove: units, the nftables table, a tunnel, builds, models,
    caches). A host that already left the file cannot be found this way."""
    common.patch_for_gevent()
    from meshdeploy.engine.planner import make_destroy_plan

    cluster = load_cluster(args.file)
    if args.action == "show":
        print(view.render_json(states.load(cluster).to_dict()))
        return errors.OK
    with common.Locked(cluster, "state rebuild", args.lock_timeout) as lock:
        session = cluster_hosts.open_session(cluster, None, args.accept_new_host_keys)
        try:
            lock.hosts(session)
            planned = make_destroy_plan(session, purge=True)
        finally:
            lock.release_hosts()
            session.close()
    fresh = states.State(path=states.state_path(cluster.path), cluster=cluster.name)
    found = {}
    for host in cluster.hosts:
        found[host.name] = sorted({f"{c.role}.{c.resource}" for c in planned.plan.changes
                                   if c.host == host.name})
        if found[host.name]:
            fresh.hosts[host.name] = states.record_for(cluster, host)
    states.save(fresh)
    print(view.render_rebuilt(found, str(fresh.path), len(fresh.hosts)))
    return errors.OK
