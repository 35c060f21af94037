"""What the network costs per token: the plan's Network rows from the probe's round trips
(services.Rtt, measured from each orchestrator to its workers' SSH ports)."""

from __future__ import annotations

from meshdeploy.core.plan import Network, RttEndpoint


def network(cluster, hosts, facts) -> list[Network]:
    """Measured RTT orchestrator -> workers and the per-token cost it implies."""
    out = []
    for server in cluster.servers:
        if server.host not in {h.name for h in hosts}:
            continue
        rtts = (facts.get(server.host) or {}).get("services.Rtt") or {}
        measured, remote, unreachable = [], [], []
        for e in cluster.rpc_endpoints(server):
            us = rtts.get(e.ssh_target)
            if e.host.name == server.host:
                measured.append(RttEndpoint(e.target, e.host.name, 0.0, remote=False))
            elif us is not None:
                measured.append(RttEndpoint(e.target, e.host.name, us / 1000, remote=True))
                remote.append(us)  # a fast link measures 0 after the probe's own cost: still a hop
            elif e.ssh_target in rtts:  # probed, and no connect got there (a tunnel not up yet)
                unreachable.append(e.target)
        if not measured and not unreachable:
            continue
        # Inference is pipeline-serial and the orchestrator drives every remote device in turn:
        # each token pays one round trip per remote worker (seed llamacpp-rpc-split-guide:
        # per token ~ compute + (N-1) x latency for N nodes).
        out.append(Network(server.name, server.host, measured, round_trips=len(remote),
                           per_token_ms=sum(remote) / 1000, unreachable=unreachable))
    return out
