"""What the rpc_cache role fixes for a run before any host changes (its prepare hook's values,
kept under its name in Resolved): the placements and the seeds that follow from them."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLE = "rpc_cache"


@dataclass(frozen=True)
class Run:
    seeds: dict = field(default_factory=dict)  # "host:port" -> SeedModel tuple
    layouts: tuple = ()  # placement layouts, one per server
    # Model name -> the (offset, size) of every hashed tensor of a model that workers fetch
    # from another host's copy (what that host's digest list covers).
    shared: dict = field(default_factory=dict)
    # Server name -> the -ts values placement: auto chose (the services role writes them into
    # llama-server's argv); absent where the split stays llama.cpp's or the file's.
    splits: dict = field(default_factory=dict)
    # Server name -> its failover.Run tuple: the full placement (workers without layers left off
    # --rpc), then one per set of workers it may lose (servers.NAME.failover); the services
    # role starts md-failover with them.
    failover: dict = field(default_factory=dict)
    # "host:port" -> why that cached rpc-server's seeds are left as they are in this run
    # (seeding.SeedPlan.kept).
    kept: dict = field(default_factory=dict)


def of(resolved) -> Run:
    """The run's values (empty ones where the role's prepare has not run: a test's Resolved)."""
    return resolved.of(ROLE) or Run()
