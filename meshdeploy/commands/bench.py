"""meshdeploy bench: tokens/s of a deployed llama-server, measured through its HTTP API and read
from its own `timings`, optionally against the same build and model on the orchestrator alone
(--compare-local), or at several layer splits to fit each device's speed (--sweep:
run_sweep here, meshdeploy.engine.sweep's machinery).

How the server is reached and measured: meshdeploy.engine.server_api. Statistics, views and
the kept result: meshdeploy.views.bench.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from datetime import datetime, timezone

from meshdeploy import errors
from meshdeploy.commands import common, options
from meshdeploy.core.loading import load_cluster
from meshdeploy.config.addresses import local_address
from meshdeploy.engine import hosts as cluster_hosts
from meshdeploy.engine import sweep, sweep_guard
from meshdeploy.engine.server_api import (
    N_PREDICT,
    SEED,
    WARMUP,
    Api,
    build_of,
    compare_local,
    connect,
    measure,
    read_key,
    rootless_layout,
)
from meshdeploy.errors import AbortedError, PlanError
from meshdeploy.remote import ssh_settings
from meshdeploy.remote.ssh_settings import SshSettings
from meshdeploy.views import bench as report
from meshdeploy.views import sweep as sweep_view

NAME = "bench"
HELP = "tokens/s of the deployed llama-servers, from their own timings"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE")
    p.add_argument("--server", metavar="NAME", help="only this server (default: every server)")
    p.add_argument("--runs", type=int, default=3, metavar="N",
                   help="measured runs over the prompt set, after one warm-up (default 3)")
    p.add_argument("--compare-local", action="store_true",
                   help="also run the same build and model on the orchestrator alone, when it "
                        "fits, and show cluster/local")
    p.add_argument("--sweep", action="store_true",
                   help="measure several layer splits (stopping the deployed llama-server "
                        "meanwhile) and keep each device's fitted speed for placement: auto")
    p.add_argument("--points", type=int, metavar="N",
                   help=f"with --sweep: how many splits to measure (default {sweep.POINTS})")
    p.add_argument("--no-local", action="store_true",
                   help="with --sweep: do not also run the model on the orchestrator alone")
    p.add_argument("--restart-after", type=int, metavar="SECONDS",
                   help="with --sweep: the orchestrator starts the deployed llama-server by "
                        "itself this long after a step of the sweep began, should the sweep be "
                        f"cut off; each split must fit in it (default {sweep_guard.SECONDS})")
    options.auto_approve(p)
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    options.limit(p, "only the servers these hosts run (with --sweep: and every worker of "
                     "theirs)")
    options.host_keys(p)


@dataclass(frozen=True)
class Args(options.Arguments):
    file: str
    server: str | None
    runs: int
    compare_local: bool
    sweep: bool
    points: int | None
    no_local: bool
    restart_after: int | None
    auto_approve: bool
    json: bool
    limit: list[str] | None
    accept_new_host_keys: bool


# -- the server and its build ------------------------------------------------------------------

def bench_server(cluster, server, settings: SshSettings, runs: int, n_predict: int,
                 local: bool, progress) -> dict:
    conn = connect(settings)
    try:
        host = cluster.host(server.host)
        prefix = cluster.prefix
        layout = None
        if host.rootless:
            # Everything is the login user's own there (the key file too): never sudo.
            layout, sudo = rootless_layout(conn, host), False
            prefix = layout.prefix
        else:
            # The key file, the process's argv and systemd-run need root.
            sudo = settings.sudo if settings.local else settings.user != "root"
        key = read_key(conn, server, sudo)
        # The key goes only to the deployed unit's own listener (a rootless host's: its user
        # unit's cgroup, or its runit service's process tree).
        api = Api(conn, local_address(server.bind), server.port, key, unit=server.unit_name,
                  sudo=sudo, layout=layout)
        api.wait_healthy(0)
        build = build_of(conn, api, prefix)
        progress(f"llama-server {server.name} on {server.host}: {runs} runs")
        result = {"server": server.name, "host": server.host, "model": server.model,
                  "build": build, "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "params": {"runs": runs, "warmup": WARMUP, "n_predict": n_predict,
                             "seed": SEED, "temperature": 0, "cache_prompt": False},
                  **measure(api, runs, n_predict, progress)}
        if local and host.rootless:
            result["local"] = {"skipped": f"{server.host} is rootless: the comparison runs as a "
                                          "transient system unit, which needs root"}
        elif local:
            result["local"] = compare_local(conn, sudo, cluster, server, key, runs, n_predict,
                                            progress)
            if "skipped" not in result["local"]:
                result["ratio_to_local"] = report.ratio(result["overall"],
                                                        result["local"]["overall"])
        return result
    finally:
        conn.close()


def run(args: Args) -> int:
    common.patch_for_gevent()
    common.interrupts_in_main_greenlet()
    cluster = load_cluster(args.file)
    names = [s.name for s in cluster.servers]
    if args.server and args.server not in names:
        raise PlanError(f"--server {args.server!r} is not a server of {args.file}",
                        hint=f"servers in the file: {', '.join(names) or 'none'}")
    servers = [s for s in cluster.servers if not args.server or s.name == args.server]
    if args.limit:
        kept = set(cluster_hosts.limited(cluster, args.limit))
        servers = [s for s in servers if s.host in kept and (
            not args.sweep or set(sweep.hosts_of(cluster, [s])) <= kept)]
        if not servers:
            raise PlanError(f"--limit {','.join(args.limit)} leaves no server to bench",
                            hint="name a server's host" + (" and every worker of it"
                                                           if args.sweep else ""))
    if not servers:
        raise PlanError(f"{args.file} has no servers to bench",
                        hint="add a servers: entry and apply it")
    if args.runs < 1:
        raise PlanError("--runs must be at least 1")
    if args.sweep and args.compare_local:
        raise PlanError("--sweep and --compare-local cannot be used together",
                        hint="run bench --compare-local and bench --sweep one after the other")
    if args.points is not None and not args.sweep:
        raise PlanError("--points is an option of --sweep", hint="add --sweep, or drop --points")
    if args.no_local and not args.sweep:
        raise PlanError("--no-local is an option of --sweep",
                        hint="add --sweep, or drop --no-local")
    if args.restart_after is not None and not args.sweep:
        raise PlanError("--restart-after is an option of --sweep",
                        hint="add --sweep, or drop --restart-after")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.sweep:
        return run_sweep(args, cluster, servers, progress)

    previous = report.read_state(cluster.path)
    results = []
    for server in servers:
        settings = ssh_settings.resolve(cluster.host(server.host),
                                        accept_new=args.accept_new_host_keys)
        result = bench_server(cluster, server, settings, args.runs, N_PREDICT,
                              args.compare_local, progress)
        result["change"] = report.change(result, previous.get(server.name))
        results.append(result)
    state = report.write_state(cluster.path, results)
    if args.json:
        print(report.render_json(cluster.name, results, str(state)))
    else:
        print(report.render_text(results, kept=str(state)))
    return errors.OK


def run_sweep(args: Args, cluster, servers, progress) -> int:
    """bench --sweep of `servers` (engine.sweep); run checked the file, --server and --runs."""
    from meshdeploy.engine import speeds

    points = sweep.POINTS if args.points is None else args.points
    if points < 2:
        raise PlanError("--points must be at least 2")
    restart_after = sweep_guard.SECONDS if args.restart_after is None else args.restart_after
    if restart_after < sweep.MIN_RESTART_AFTER:
        raise PlanError(f"--restart-after must be at least {sweep.MIN_RESTART_AFTER} seconds",
                        hint="it is how long one split (loading included) may take before "
                             "the orchestrator starts the deployed server by itself")
    if args.json and not args.auto_approve:
        raise PlanError("bench --sweep --json cannot ask for confirmation",
                        hint="add --auto-approve")
    skipped = {s.name: why for s in servers if (why := sweep.skip(cluster, s)) is not None}
    swept = [s for s in servers if s.name not in skipped]
    for server in swept:
        n = len(cluster.server_devices(server))
        if points < n + 1:
            raise PlanError(f"--points {points} is too few for server {server.name}'s {n} "
                            f"devices", hint=f"give at least {n + 1}: {n} to fit the devices' "
                            "speeds, and one more so each split is predicted from the others")
    results = [{"server": s.name, "host": s.host, "skipped": skipped[s.name]}
               for s in servers if s.name in skipped]
    print(sweep_view.render_notice(swept, results), file=sys.stderr)
    if swept and not args.auto_approve and not common.confirm("bench --sweep"):
        raise AbortedError("bench --sweep cancelled: nothing was stopped")
    with common.Locked(cluster, "bench --sweep") as lock:
        session = cluster_hosts.open_session(cluster, sweep.hosts_of(cluster, swept),
                                             args.accept_new_host_keys) if swept else None
        try:
            if session is not None:
                lock.hosts(session)  # no apply changes these hosts during the sweep
            for server in swept:
                settings = ssh_settings.resolve(cluster.host(server.host),
                                                accept_new=args.accept_new_host_keys)
                results.append(sweep.sweep_server(cluster, server, settings, args.runs, points,
                                                  not args.no_local, progress, restart_after))
        finally:
            lock.release_hosts()
            if session is not None:
                session.close()
    order = [s.name for s in servers]
    results.sort(key=lambda r: order.index(r["server"]))
    kept = str(speeds.path(cluster.path))
    print(sweep_view.render_json(cluster.name, results, kept) if args.json
          else sweep_view.render_text(results))
    # A server that could not be swept said why; one whose splits could not be fitted failed.
    return errors.ERROR if any("fit_error" in r for r in results) else errors.OK
