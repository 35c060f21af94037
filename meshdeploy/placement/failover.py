"""Which placement runs while workers are away: for every set of worker hosts a llama-server may
lose (up to failover.tolerate), the placement md-failover starts instead, by the same memory and
speed model as the full placement (layout.build), or why none can serve.

A Run is one way md-failover may start the server (the hosts away, its --rpc list, its -ts
values); run_of gives the full placement's, degraded every fallback's. rpc_cache carries them in
its run values (SeedPlan.runs), services renders them into md-failover's argv, and the plan's
placement section lists them (layout.sections).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import combinations

from meshdeploy.errors import PlanError
from meshdeploy.placement import defaults as d
from meshdeploy.placement import kvcache
from meshdeploy.placement.layout import Layout, _gb, build
from meshdeploy.placement.memory import device_free

@dataclass(frozen=True)
class Run:
    """One way md-failover may start a llama-server: the worker hosts away (() for the full
    placement), the rpc-servers it dials ("host:port", in --rpc order) and the -ts values
    (None: llama.cpp's split by memory), with the layout they give, or why they cannot serve."""

    lost: tuple[str, ...]
    rpc: tuple[str, ...]
    split: tuple[float, ...] | None
    layout: Layout | None
    refusal: str | None = None


def _counts(placement) -> tuple[float, ...]:
    """-ts values that reproduce `placement` exactly: each device's layer count, the output's
    slot on the device that takes it (placement.auto_split's form)."""
    return tuple(float(len(placement.layers_of(i)) + (placement.output_device == i))
                 for i in range(len(placement.devices)))


def _written_split(server, lay: Layout):
    """The -ts values the server starts with: placement: auto's, the file's, or None (memory)."""
    if lay.split is not None:
        return tuple(float(v) for v in lay.split)
    return None if server.tensor_split == "auto" else tuple(server.tensor_split)


def run_of(cluster, server, lay: Layout, lost: tuple[str, ...] = ()) -> Run:
    """The run of `server` (its rpc list as the layout was built from) with every rpc-server
    the layout gives no layers left off --rpc: it would hold nothing, yet its loss would still
    take llama-server down. Where one is left off, the split is written out as layer counts
    (llama.cpp's split by memory would then also count what the others left free)."""
    devs = cluster.server_devices(server)
    refs = [e.ref for e in cluster.rpc_endpoints(server)]
    used = {(r["host"], r["port"]) for r in lay.rows if r["used"]}
    idle = [ref for ref, e in zip(refs, cluster.rpc_endpoints(server))
            if (e.host.name, e.rpc.port) not in used]
    split = _written_split(server, lay)
    if not idle:
        return Run(lost, tuple(refs), split, lay)
    keep = [i for i, (_, h, _, e) in enumerate(devs) if e is None or e.ref not in idle]
    values = _counts(lay.placement) if split is None else split + (0.0,) * (len(devs) - len(split))
    return Run(lost, tuple(r for r in refs if r not in idle), tuple(values[i] for i in keep), lay)


def _measured_without(measured: dict | None, labels, kept) -> dict | None:
    """The kept device speeds of the devices `kept` (indexes into `labels`), as if measured
    on them alone: each device's seconds per byte and round trip are its own."""
    if not measured or measured.get("devices") != list(labels):
        return None
    out = dict(measured, devices=[labels[i] for i in kept])
    for key in ("gen", "prompt", "rtt"):
        values = measured.get(key)
        if isinstance(values, list) and len(values) == len(labels):
            out[key] = [values[i] for i in kept]
    out["alone"] = None  # the sweep's "alone" run is the orchestrator's, with every device gone
    return out


def degraded(cluster, server, tensors, shape, device_memory: dict, measured: dict | None = None,
             commit: str | None = None) -> list[Run]:
    """The run of `server` for every set of up to failover.tolerate of its worker hosts away,
    by the same memory and speed model as the full placement; a set that cannot serve carries
    the refusal ("does not fit: ...")."""
    workers = cluster.worker_hosts(server)
    if server.failover.tolerate <= 0 or not workers:
        return []
    devs = cluster.server_devices(server)
    labels = [label for label, *_ in devs]
    out = []
    for n in range(1, min(server.failover.tolerate, len(workers)) + 1):
        for lost in combinations(workers, n):
            kept_refs = tuple(e.ref for e in cluster.rpc_endpoints(server)
                              if e.host.name not in lost)
            kept = [i for i, (_, h, _, _) in enumerate(devs) if h.name not in lost]
            split = server.tensor_split
            if split != "auto":
                values = list(split) + [0.0] * (len(devs) - len(split))
                split = tuple(values[i] for i in kept)
                if not any(split):
                    split = "auto"
            sub = replace(server, rpc=kept_refs, tensor_split=split)
            try:
                lay = build(cluster, sub, tensors, shape, device_memory,
                            _measured_without(measured, labels, kept), commit)
                if not sub.rpc:
                    _refuse_alone(lay, sub, shape, device_memory, cluster)
            except PlanError as exc:
                out.append(Run(lost, kept_refs, None, None, exc.message))
                continue
            out.append(run_of(cluster, sub, lay, lost))
    return out


def _refuse_alone(lay: Layout, server, shape: dict, device_memory: dict, cluster) -> None:
    """A server left with no rpc-server runs every layer on its own host: its RAM (or its own
    devices, which build() checked) must hold what the workers held."""
    if lay.rows:
        return
    ram = device_free(device_memory.get(server.host),
                      cluster.host(server.host).backend, "CPU")
    kv = kvcache.layer_bytes(shape, lay.kv)
    needed = sum(shape["layer_bytes"]) + shape["output_device_bytes"] + sum(kv) + \
        d.placement_compute_headroom_bytes
    if ram is not None and needed > ram.usable:
        raise PlanError(f"servers.{server.name}: alone on {server.host}, {lay.model} needs "
                        f"{_gb(needed)} GB, {_gb(ram.usable)} GB available")
