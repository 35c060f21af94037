"""From the cluster file to what each cached rpc-server must hold, and the plan's placement table.

Computed once per plan on the control machine: the GGUF header is read with Range requests from
the control machine's view of the hub (huggingface.api_endpoint), never from a host, and
llama.cpp's layer split is reproduced for every llama-server that loads through a cached
rpc-server. The result (Resolved.seeds, Resolved.layouts) feeds rpc_cache.seed[port] and the
text plan.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, field

from meshdeploy.deploy.context import HostContext, Step
from meshdeploy.deploy.errors import PlanError
from meshdeploy.deploy.model import HfSource
from meshdeploy.roles.models import operations as models
from meshdeploy.roles.rpc_cache import defaults as d
from meshdeploy.roles.rpc_cache import operations as ops
from meshdeploy.roles.rpc_cache.placement import device_tensors, fits, place, wire_bytes
from meshdeploy.roles.rpc_cache.tensors import (GgufHeaderError, header_from_http, model_shape,
                                                read_header, weight_tensors)


@dataclass
class Layout:
    """Where one llama-server's layers land, and what that costs each device."""

    server: str
    model: str
    placement: object  # placement.Placement
    rows: list = field(default_factory=list)  # one dict per device (see table())


def header_url(cluster, model) -> str:
    """The control machine's URL of the model's first file, pinned to the resolved commit."""
    src = model.source
    api = (src.endpoint or cluster.huggingface.api_endpoint).rstrip("/")
    return f"{api}/{src.repo}/resolve/{{commit}}/{src.files[0]}"


def cached_servers(cluster):
    """(server, endpoints) for every llama-server that loads through a cached rpc-server."""
    out = []
    for server in cluster.servers:
        endpoints = cluster.rpc_endpoints(server)
        if any(e.rpc.cache for e in endpoints):
            out.append((server, endpoints))
    return out


def _device_memory(facts: dict | None, host, device: str) -> tuple[int | None, int | None]:
    """(free as llama.cpp reports it for the split, free for the headroom check) of one device.

    The CPU backend reports physical memory as free (ggml-cpu.cpp: "assume that all of it is
    free"), so the split follows MemTotal while the headroom uses MemAvailable.
    """
    mem = (facts or {}).get("rpc_cache.DeviceMemory")
    if not mem:
        return None, None
    if device == "CPU" or (host.backend == "cpu" and device.startswith("CPU")):
        cpu = mem.get("cpu") or {}
        return cpu.get("total"), cpu.get("available")
    if device.startswith("CUDA") and device[4:].isdigit():
        gpus = mem.get("cuda") or []
        i = int(device[4:])
        if i < len(gpus):
            return gpus[i]["free"], gpus[i]["free"]
    return None, None


def _devices(cluster, server, endpoints):
    """[(label, host, device, endpoint or None)] in -ts order."""
    out = []
    for e in endpoints:
        out += [(f"{e.host.name}:{e.rpc.port}/{dev}", e.host, dev, e) for dev in e.devices]
    local = cluster.host(server.host)
    out += [(f"{server.host}/{dev}", local, dev, None) for dev in local.devices]
    return out


def layout(cluster, server, endpoints, tensors, shape, facts: dict) -> Layout:
    """Placement of one server plus per-device bytes; raises PlanError when it cannot be known."""
    devs = _devices(cluster, server, endpoints)
    labels = [label for label, *_ in devs]
    memory = [_device_memory(facts.get(h.name), h, dev) for _, h, dev, _ in devs]
    where = f"servers.{server.name}"
    try:
        if server.tensor_split == "auto":
            unknown = [labels[i] for i, (split, _) in enumerate(memory) if split is None]
            if unknown:
                raise PlanError(f"{where}: the rpc cache needs to know which layers each worker "
                                f"gets, and the free memory of {', '.join(unknown)} is unknown "
                                "(host not probed, or a backend meshdeploy cannot query)",
                                hint=f"set {where}.tensor_split, or plan without --limit")
            placement = place(shape["n_layers"], labels, None, [m[0] for m in memory],
                              server.n_gpu_layers)
        else:
            placement = place(shape["n_layers"], labels, list(server.tensor_split), None,
                              server.n_gpu_layers)
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}", hint=f"fix {where}.tensor_split") from None
    ctx = server.ctx_size or shape["n_ctx_train"]
    avail = [m[1] for m in memory]
    fit = fits(placement, shape, ctx, [a or 0 for a in avail])
    out = Layout(server.name, server.model, placement)
    for i, (label, host, dev, endpoint) in enumerate(devs):
        mine = device_tensors(placement, tensors, i)
        cached, small = wire_bytes(mine)
        seeded = endpoint is not None and endpoint.rpc.cache
        layers = placement.layers_of(i)
        text = (f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else
                (str(layers[0]) if layers else "-"))
        if placement.output_device == i:
            text += " + output"
        f = fit[i]
        out.rows.append({
            "device": label, "layers": text, "weights": f.weights, "kv": f.kv,
            "seed": cached if seeded else 0,
            # A local device reads the file itself; an RPC one receives every byte not cached.
            "wire": 0 if endpoint is None else (small if seeded else cached + small),
            "free": avail[i], "headroom": None if avail[i] is None else avail[i] - f.needed,
            "host": host.name, "port": endpoint.rpc.port if endpoint else None,
            "cached": seeded, "tensors": mine,
        })
    return out


def _header(cluster, model, hf_model, token, fetch, cache: Path | None, where: str):
    url = header_url(cluster, model).format(commit=hf_model.commit)
    file = hf_model.files[0]
    kept = cache / f"{file.sha256}.gguf" if cache else None
    path = None
    try:
        if kept is not None and kept.exists():
            return read_header(str(kept))
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            path = fetch(url, file.size, token=token, dest=kept.with_suffix(".tmp"))
            header = read_header(str(path))
            os.replace(path, kept)  # only a header that parsed is kept
            path = None
            return header
        path = fetch(url, file.size, token=token)
        return read_header(str(path))
    except GgufHeaderError as exc:
        raise PlanError(f"{where}: cannot read the GGUF header: {exc}",
                        hint="check huggingface.api_endpoint and the file") from None
    finally:
        if path is not None:
            os.unlink(path)


def prepare(cluster, hosts, facts: dict, resolved, fetch=header_from_http,
            header_cache: Path | None = None) -> None:
    """Fill resolved.seeds ("host:port" -> SeedModel tuple) and resolved.layouts.

    + header_cache: a folder keeping fetched headers by file sha256 (the content they describe
      never changes), so a no-op plan does not fetch megabytes of header again; None: no cache
    """
    names = {h.name for h in hosts}
    seeds: dict[str, list] = {}
    headers: dict[str, object] = {}
    for server, endpoints in cached_servers(cluster):
        model = cluster.models[server.model]
        where = f"models.{model.name}"
        if not isinstance(model.source, HfSource) or len(model.source.files) != 1:
            raise PlanError(f"{where}: rpc-server cache seeding (cache: true on a worker of "
                            f"servers.{server.name}) needs a one-file Hugging Face model",
                            hint="use a single-file huggingface model, or set cache: false")
        hf_model = resolved.models.get(model.name)
        if hf_model is None:
            continue  # no host in --limit loads it: nothing to seed in this run
        if model.name not in headers:
            headers[model.name] = _header(cluster, model, hf_model, resolved.hf_token, fetch,
                                          header_cache, where)
        header = headers[model.name]
        layout_ = layout(cluster, server, endpoints, weight_tensors(header),
                         model_shape(header), facts)
        resolved.layouts.append(layout_)
        for row in layout_.rows:
            if not row["cached"] or row["host"] not in names:
                continue
            key = f"{row['host']}:{row['port']}"
            seed = ops.SeedModel(models.model_path(cluster, model.name),
                                 hf_model.files[0].sha256, tuple(row["tensors"]))
            merged = seeds.setdefault(key, [])
            # One rpc-server may expose several devices: one entry per model, tensors united.
            for i, have in enumerate(merged):
                if have.model_sha == seed.model_sha:
                    union = {t.offset: t for t in have.tensors + seed.tensors}
                    merged[i] = ops.SeedModel(have.model_path, have.model_sha,
                                              tuple(sorted(union.values(), key=lambda t: t.offset)))
                    break
            else:
                merged.append(seed)
    resolved.seeds = {k: tuple(v) for k, v in seeds.items()}


def seed(ctx: HostContext, port: int) -> Step:
    """rpc_cache.seed[port] for this host, from what prepare() computed."""
    rpc = ctx.host.rpc_server(port)
    wanted = ctx.resolved.seeds.get(f"{ctx.host.name}:{port}") if rpc and rpc.cache else None
    if not wanted:
        if rpc is not None and rpc.cache:
            return Step(ctx.change(ops.ROLE, f"seed[{port}]", "no-op",
                                   "no llama-server loads through this rpc-server"))
        return ops.seed(ctx, port, "", [], d.cache_dir_for(port), "-")
    first, *also = wanted
    return ops.seed(ctx, port, first.model_path, list(first.tensors), d.cache_dir_for(port),
                    first.model_sha, tuple(also))


def _gb(n) -> str:
    return "?" if n is None else f"{n / 1e9:.2f}"


def table(layouts: list[Layout]) -> str:
    """The placement section of the text plan: one block per llama-server."""
    from tabulate import tabulate

    blocks = []
    for lay in layouts:
        rows = [[r["device"], r["layers"], _gb(r["weights"]), _gb(r["kv"]),
                 _gb(r["seed"]) if r["cached"] else "-", f"{r['wire'] / 1e6:.1f}",
                 _gb(r["free"]), _gb(r["headroom"])] for r in lay.rows]
        head = ["device", "layers", "weights GB", "KV GB", "seeded GB", "wire MB/load",
                "free GB", "headroom GB"]
        body = tabulate(rows, headers=head, tablefmt="simple", disable_numparse=True)
        text = "\n".join(line.rstrip() for line in body.splitlines())
        blocks.append(f"Placement of {lay.model} for llama-server {lay.server} "
                      f"(as llama.cpp splits it):\n{text}")
    return "\n\n".join(blocks)
