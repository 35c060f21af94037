"""Where one llama-server's layers land, what that costs each device, and whether it fits.

Computed on the control machine from the GGUF header (tensors.model_shape), the server's
settings (tensor_split, n_gpu_layers, ctx_size, extra_args) and the DeviceMemory fact of every
host involved. The plan carries it as typed sections (sections()) that the views print; a
placement that cannot fit is refused with the numbers that prove it, before anything is installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from meshdeploy.core.plan import FailoverRow, Placement, PlacementRow, Speed
from meshdeploy.errors import PlanError
from meshdeploy.placement import defaults as d
from meshdeploy.placement import kvcache, speed
from meshdeploy.placement.layers import device_tensors, fits, place, wire_bytes
from meshdeploy.placement.memory import device_free


# How much faster another split must be predicted before the plan suggests it, and before
# placement: auto leaves llama.cpp's split by memory; more where the measured speeds' own
# error (Calibration.error) is larger.
BETTER = 1.10
WORTH = 1.05


@dataclass
class Layout:
    server: str
    model: str
    placement: object  # placement.Placement
    kv: kvcache.KvSettings
    rows: list = field(default_factory=list)  # one dict per device (see build())
    unknown: list = field(default_factory=list)  # devices whose free memory is not known
    fitted_from: int | None = None  # ctx_size 0 that llama.cpp shrinks: the context it wanted
    split_by: str = "memory"  # "memory", "tensor_split" or "speed" (core.plan.Placement)
    split: tuple[int, ...] | None = None  # placement: auto's -ts values (split_by "speed")
    speed: object = None  # core.plan.Speed: the predicted tokens/s; None without a measurement
    notes: list = field(default_factory=list)  # what placement: auto says in the plan


def _memory(device_memory: dict, host, device: str):
    return device_free(device_memory.get(host.name),
                       host.backend, device, host.vulkan_visible)


def _short(fit, memory, margin: int) -> bool:
    """Whether a device of known memory keeps less than `margin` bytes free."""
    return any(m is not None and m.usable - f.needed < margin for f, m in zip(fit, memory))


def unknown_memory(cluster, server, device_memory: dict) -> list[str]:
    """Labels of the server's devices whose free memory `device_memory` does not give."""
    return [label for label, h, dev, _ in cluster.server_devices(server)
            if _memory(device_memory, h, dev) is None]


def _shares_ram(device: str) -> bool:
    """CPU buffers and Apple's unified memory come out of the same host RAM."""
    return device == "CPU" or device.startswith(("CPU", "MTL"))


def build(cluster, server, tensors, shape, device_memory: dict, measured: dict | None = None,
          commit: str | None = None) -> Layout:
    """The layout of `server`; PlanError for a split llama.cpp would refuse or one that cannot fit.

    + tensors: tensors.weight_tensors(header); shape: tensors.model_shape(header)
    + device_memory: host name -> the host's device memory fact (memory.device_free reads it;
      a host absent or None: unknown)
    + measured: the server's kept device speeds (engine.speeds), used while they match its
      devices, the build's `commit` and the model: for placement: auto, and for predictions
    Example: build(...).rows[0] == {"device": "box11:50052/CUDA0", "layers": "0-25", ...}
    """
    devs = cluster.server_devices(server)
    labels = [label for label, *_ in devs]
    memory = [_memory(device_memory, h, dev) for _, h, dev, _ in devs]
    where = f"servers.{server.name}"
    unknown = [labels[i] for i, m in enumerate(memory) if m is None]
    try:
        if server.tensor_split == "auto":
            if unknown:
                raise PlanError(f"{where}: with tensor_split auto, llama.cpp splits the layers by "
                                f"free memory, and the free memory of {', '.join(unknown)} is "
                                "unknown (host not probed, or a backend meshdeploy cannot query)",
                                hint=f"set {where}.tensor_split, or plan without --limit")
            placement = place(shape["n_layers"], labels, None, [m.split for m in memory],
                              server.n_gpu_layers)
        else:
            placement = place(shape["n_layers"], labels, list(server.tensor_split), None,
                              server.n_gpu_layers)
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}", hint=f"fix {where}.tensor_split") from None
    try:
        kv = kvcache.settings(server.ctx_size, shape["n_ctx_train"], server.extra_args)
        kv_layer = kvcache.layer_bytes(shape, kv)
    except ValueError as exc:
        raise PlanError(f"{where}: {exc}", hint=f"fix {where}.extra_args") from None
    usable = [m.usable if m else 0 for m in memory]
    fit = fits(placement, shape, kv_layer, usable)
    fitted_from = None
    if server.ctx_size == 0 and _short(fit, memory, kvcache.FIT_MARGIN):
        # llama.cpp's -fit shrinks an unset context to what memory holds: predict where it stops.
        def fits_at(n_ctx, margin=kvcache.FIT_MARGIN):
            trial = fits(placement, shape, kvcache.layer_bytes(shape, replace(kv, n_ctx=n_ctx)),
                         usable)
            return not _short(trial, memory, margin)
        n_ctx = kvcache.fitted_ctx(kv, shape["n_ctx_train"], fits_at) or \
            kvcache.fit_floor(kv, shape["n_ctx_train"])
        fitted_from, kv = (kv.n_ctx, replace(kv, n_ctx=n_ctx)) if n_ctx < kv.n_ctx else (None, kv)
        kv_layer = kvcache.layer_bytes(shape, kv)
        fit = fits(placement, shape, kv_layer, usable)
    memory_placement = placement if server.tensor_split == "auto" else None
    cal, why = current_calibration(measured, labels, commit, tensors)
    split_by = "memory" if server.tensor_split == "auto" else "tensor_split"
    keep = [h.keep_free for _, h, _, _ in devs]
    split, notes = _for_speed(server, cal, why, labels, shape, kv_layer, memory, keep, fit,
                              placement)
    # The advice needs every device's memory, and every layer on a device the model places.
    if cal is not None and None not in memory and \
            not 0 <= server.n_gpu_layers <= shape["n_layers"]:
        notes += _advice(server, cal, devs, shape, kv_layer, memory, keep,
                         placement if split is None else None)
    if split is not None:
        placement = place(shape["n_layers"], labels, list(split), None, server.n_gpu_layers)
        fit = fits(placement, shape, kv_layer, usable)
        split_by = "speed"
    out = Layout(server.name, server.model, placement, kv, unknown=unknown,
                 fitted_from=fitted_from, split_by=split_by, split=split, notes=notes,
                 speed=_predict(cal, placement, memory_placement, shape))
    for i, (label, host, dev, endpoint) in enumerate(devs):
        mine = device_tensors(placement, tensors, i)
        cached, small = wire_bytes(mine)
        seeded = endpoint is not None and endpoint.rpc.cache
        layers = placement.layers_of(i)
        # "layers" words the refusal message; the plan's views print first/last/output.
        text = (f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else
                (str(layers[0]) if layers else "-"))
        if placement.output_device == i:
            text += " + output"
        m = memory[i]
        out.rows.append({
            "device": label, "layers": text, "first": layers[0] if layers else None,
            "last": layers[-1] if layers else None, "output": placement.output_device == i,
            "weights": fit[i].weights, "kv": fit[i].kv,
            "needed": fit[i].needed, "seed": cached if seeded else 0,
            # A local device reads the file itself; an RPC one receives every byte not cached.
            "wire": 0 if endpoint is None else (small if seeded else cached + small),
            "free": m.usable if m else None, "estimated": bool(m and m.estimated),
            "headroom": None if m is None else m.usable - fit[i].needed,
            "host": host.name, "port": endpoint.rpc.port if endpoint else None,
            "cached": seeded, "tensors": mine, "pool": _shares_ram(dev),
            "keep_free": host.keep_free,
            "used": bool(layers) or placement.output_device == i,
        })
    _refuse_if_short(out, where, device_memory, cluster)
    return out


def _for_speed(server, cal, why: str, labels, shape: dict, kv_layer: list[int], memory, keep,
               fit, current):
    """(placement: auto's -ts values, or None to keep the split as it is; the plan's notes).
    Without placement: auto, a note when auto would be BETTER faster than the split now.
    + keep: bytes of each device its host keeps free; fit, current: the split now (llama.cpp's
      by memory, or the file's tensor_split) and its DeviceFit rows"""
    where = f"servers.{server.name}"
    if server.placement == "auto":
        split, notes = _speed_split(server, cal, why, shape, kv_layer, memory, keep)
        # Why auto split by memory is said where the file asked for auto; the default is quiet.
        notes = notes if server.placement_set else []
        if split is None:
            return None, notes
        chosen = place(shape["n_layers"], labels, list(split), None, server.n_gpu_layers)
        gain = cal.gen_rate(speed.held_bytes(chosen, shape)) / \
            cal.gen_rate(speed.held_bytes(current, shape))
        # The split by memory is kept only where it leaves each host's keep_free_gb.
        admissible = all(f.needed == 0 or m.usable - f.needed >= k
                         for f, m, k in zip(fit, memory, keep))
        worth = max(WORTH, 1 + cal.error)
        if gain < worth and admissible:
            kept = (f"{where}: placement auto keeps the split by memory: no other split is "
                    f"predicted {worth - 1:.0%} faster (the best: {gain:.2f}x; the measured "
                    f"speeds' own error: {cal.error:.0%})")
            return None, notes + ([kept] if server.placement_set else [])
        return split, notes
    if cal is None or None in memory:
        return None, []
    faster, _ = _speed_split(server, cal, why, shape, kv_layer, memory, keep)
    if faster is None:
        return None, []
    now = cal.gen_rate(speed.held_bytes(current, shape))
    then = cal.gen_rate(speed.held_bytes(
        place(shape["n_layers"], labels, list(faster), None, server.n_gpu_layers), shape))
    if then < max(BETTER, 1 + cal.error) * now:
        return None, []
    which = "split by memory" if server.tensor_split == "auto" else "the file's tensor_split"
    return None, [f"{where}: placement: auto would split {','.join(map(str, faster))} and "
                  f"generate ~{then:.2f} tok/s ({which}: ~{now:.2f}), from the device speeds "
                  f"measured {cal.measured_at or '(unknown time)'}"]


def _capacity(memory, keep) -> list[int]:
    """Bytes each device may give a server's layers, KV and output."""
    return [max(m.usable - d.placement_compute_headroom_bytes - k, 0)
            for m, k in zip(memory, keep)]


def _best_rate(cal, shape: dict, kv_layer: list[int], capacity: list[int]):
    """(the generation tok/s of the fastest split that fits `capacity`, its -ts counts), or
    None when none fits."""
    counts = speed.fastest_counts(cal, shape, kv_layer, capacity)
    if counts is None:
        return None
    return cal.gen_rate(speed.held_bytes(
        place(shape["n_layers"], list(cal.devices), list(counts), None), shape)), counts


SLOWER = 2.0  # a device this many times slower per GB than another is named in the plan


def _advice(server, cal, devs, shape: dict, kv_layer: list[int], memory, keep,
            current) -> list[str]:
    """What no split can change, said with the measured speeds: another host would serve the
    model faster (its devices' round trips go, the orchestrator's come), the orchestrator
    alone would, or one device is much slower per GB than another.
    + current: the split the plan keeps (memory or the file's tensor_split), or None when
      placement: auto chose it by speed (the two notes about the split itself are then moot)"""
    where = f"servers.{server.name}"
    need = max(BETTER, 1 + cal.error)
    capacity = _capacity(memory, keep)
    here = _best_rate(cal, shape, kv_layer, capacity)
    out = []
    if here is None:
        return []
    now = here[0] if current is None else cal.gen_rate(speed.held_bytes(current, shape))
    if cal.alone_gen is not None:
        if cal.alone_gen >= need * now:
            out.append(f"{where}: {server.model} on {server.host} alone, without workers, "
                       f"generated ~{cal.alone_gen:.2f} tok/s in bench --sweep (measured "
                       f"{cal.measured_at or '(unknown time)'}); this split is predicted at "
                       f"~{now:.2f}")
    elif current is not None:
        local = [c if endpoint is None else 0 for c, (*_, endpoint) in zip(capacity, devs)]
        alone = _best_rate(cal, shape, kv_layer, local) if any(local) else None
        if alone is not None and alone[0] >= need * now:
            out.append(f"{where}: {server.model} fits on {server.host} alone: ~{alone[0]:.2f} "
                       f"tok/s without workers (as planned: ~{now:.2f}), from the device speeds "
                       f"measured {cal.measured_at or '(unknown time)'}")
    out += _move_note(server, cal, devs, shape, kv_layer, capacity, here, need)
    per_gb = [(p, label) for p, (label, *_) in zip(cal.gen.per_byte, devs) if p > 0]
    if current is not None and len(per_gb) > 1:
        slow, fast = max(per_gb), min(per_gb)
        if slow[0] >= SLOWER * fast[0]:
            out.append(f"{where}: {slow[1]} generates {slow[0] / fast[0]:.1f}x slower per GB "
                       f"of weights than {fast[1]}, and the split by memory does not know it "
                       "(placement: auto does)" if server.tensor_split == "auto" else
                       f"{where}: {slow[1]} generates {slow[0] / fast[0]:.1f}x slower per GB "
                       f"of weights than {fast[1]}")
    return out


def _move_note(server, cal, devs, shape: dict, kv_layer: list[int], capacity: list[int], here,
               need: float) -> list[str]:
    """The note "serving it from HOST would give ...", for one candidate, not every host (each
    try is a search over device subsets): the remote host that holds the most layers in the
    fastest split `here` (rate, counts), whose round trips that split pays most."""
    rtt = list(cal.rtt) or [0.0] * len(devs)
    held: dict[str, int] = {}
    for count, (_, h, _, e) in zip(here[1], devs):
        if e is not None and count:
            held[h.name] = held.get(h.name, 0) + count
    if not any(rtt) or not held:
        return []
    name = max(held, key=held.get)
    link = max(r for r, (_, h, _, e) in zip(rtt, devs) if e is not None and h.name == name)
    moved = [0.0 if h.name == name else (link if e is None else r)
             for r, (_, h, _, e) in zip(rtt, devs)]
    there = _best_rate(replace(cal, rtt=tuple(moved)), shape, kv_layer, capacity)
    if there is None or there[0] < need * here[0]:
        return []
    return [f"servers.{server.name}: serving it from {name} would give ~{there[0]:.2f} tok/s "
            f"(from {server.host}: ~{here[0]:.2f} at best): {name}'s round trips of "
            f"{link * 1e3:.1f} ms go, from the device speeds and round trips measured "
            f"{cal.measured_at or '(unknown time)'}"]


def current_calibration(measured: dict | None, labels, commit: str | None, tensors):
    """(the kept speed.Calibration if it still holds for these devices, build and model, why
    not otherwise)."""
    if not measured:
        return None, "no device speeds are measured for it yet"
    try:
        cal = speed.Calibration.from_json(measured)
    except (KeyError, TypeError, ValueError):
        return None, "its kept device speeds cannot be read"
    if tuple(labels) != cal.devices:
        return None, "its devices changed since their speeds were measured"
    if commit is not None and commit != cal.commit:
        return None, "its build changed since the device speeds were measured"
    if speed.model_key(tensors) != cal.model:
        return None, "its model changed since the device speeds were measured"
    return cal, ""


def _speed_split(server, cal, why: str, shape: dict, kv_layer: list[int], memory, keep):
    """(-ts values placement: auto chooses, or None to keep the memory split; plan notes).
    + keep: bytes of each device its host keeps free (hosts.NAME.keep_free_gb)"""
    where = f"servers.{server.name}"
    if cal is None:
        return None, [f"{where}: placement auto splits by memory: {why} (run `meshdeploy bench "
                      "FILE --sweep` on the running cluster to measure them)"]
    if 0 <= server.n_gpu_layers <= shape["n_layers"]:
        return None, [f"{where}: placement auto splits by memory: n_gpu_layers "
                      f"{server.n_gpu_layers} keeps layers on the orchestrator's CPU, which "
                      "the speed model does not place"]
    counts = speed.fastest_counts(cal, shape, kv_layer, _capacity(memory, keep))
    if counts is None:
        return None, [f"{where}: placement auto splits by memory: no split fits the devices' "
                      "free memory by the speed model's count"]
    return tuple(counts), []


def _predict(cal, placement, memory_placement, shape):
    """core.plan.Speed of `placement` (and of the memory split) under `cal`; None without one."""
    if cal is None:
        return None
    held = speed.held_bytes(placement, shape)
    base = speed.held_bytes(memory_placement, shape) if memory_placement else None
    return Speed(gen_tps=round(cal.gen_rate(held), 2),
                 prompt_tps=_round(cal.prompt_rate(held)),
                 memory_gen_tps=_round(cal.gen_rate(base)) if base else None,
                 memory_prompt_tps=_round(cal.prompt_rate(base)) if base else None,
                 measured_at=cal.measured_at,
                 gen_ms_per_gb=[round(s * 1e12, 3) for s in cal.gen.per_byte],
                 rtt_ms=[round(r * 1e3, 3) for r in cal.rtt], alone_gen_tps=cal.alone_gen)


def _round(v):
    return None if v is None else round(v, 2)


def _refuse_if_short(lay: Layout, where: str, device_memory: dict, cluster) -> None:
    short = [r for r in lay.rows if r["headroom"] is not None and r["headroom"] < 0]
    lines = [f"{r['device']}: layers {r['layers']} need {_gb(r['needed'])} GB (weights "
             f"{_gb(r['weights'])}, KV {_gb(r['kv'])}, compute "
             f"{_gb(d.placement_compute_headroom_bytes)}), {_gb(r['free'])} GB "
             f"{'free (estimated)' if r['estimated'] else 'free'}" for r in short]
    # Several devices of one host that draw on its RAM (CPU, Metal) share it.
    hosts = {}
    for r in lay.rows:
        if r["pool"] and r["used"]:
            hosts.setdefault(r["host"], []).append(r)
    for name, rows in hosts.items():
        if len(rows) < 2:
            continue
        ram = device_free(device_memory.get(name),
                          cluster.host(name).backend, "CPU")
        needed = sum(r["needed"] for r in rows)
        if ram is not None and needed > ram.usable:
            lines.append(f"{name}: {', '.join(r['device'] for r in rows)} share its RAM and "
                         f"need {_gb(needed)} GB together, {_gb(ram.usable)} GB available")
    if lines:
        raise PlanError(f"{where}: {lay.model} does not fit at ctx_size {lay.kv.n_ctx}: "
                        + "; ".join(lines),
                        hint=f"lower {where}.ctx_size, move layers with {where}.tensor_split, "
                             "or add a device")


def warnings(lay: Layout) -> list[str]:
    """What the plan should say about a layout that is not refused."""
    out = []
    where = f"servers.{lay.server}"
    idle = [r["device"] for r in lay.rows if r["port"] is not None and not r["used"]]
    if idle:
        out.append(f"{where}: the tensor split gives {', '.join(idle)} no layers; it is left "
                   "off llama-server's --rpc, so its loss cannot take the server down")
    if lay.fitted_from is not None:
        out.append(f"{where}: ctx_size 0 asks for {lay.fitted_from} tokens, which do not fit; "
                   f"llama.cpp shrinks the context to fit memory (about {lay.kv.n_ctx} tokens). "
                   f"Set {where}.ctx_size to choose it")
    if lay.unknown:
        out.append(f"{where}: free memory of {', '.join(lay.unknown)} is unknown: the placement "
                   "is not checked against it")
    for r in lay.rows:
        if r["used"] and r["headroom"] is not None and r["headroom"] < r["keep_free"]:
            out.append(f"{where}: {r['device']} keeps {_gb(r['headroom'])} GB free, less than "
                       f"its host's keep_free_gb {_gb(r['keep_free'])}")
    return out + list(lay.notes)


def _gb(n) -> str:
    return "?" if n is None else f"{n / 1e9:.2f}"


def sections(layouts: list[Layout], cluster=None, runs: dict | None = None,
             extra: dict | None = None) -> list[Placement]:
    """The plan's placement section (the views print it): one Placement per llama-server, with
    its failover placements (runs: SeedPlan.runs, failover.Run tuples; extra: SeedPlan.extra)."""
    runs, extra = runs or {}, extra or {}
    out = []
    for lay in layouts:
        mine = runs.get(lay.server) or ()
        server = cluster.server(lay.server) if cluster is not None and mine else None
        full = mine[0] if mine else None
        out.append(Placement(
            server=lay.server, model=lay.model, ctx_tokens=lay.kv.n_ctx,
            ctx_fitted_from=lay.fitted_from, slots=lay.kv.n_seq,
            cache_type_k=lay.kv.type_k, cache_type_v=lay.kv.type_v,
            split_by=lay.split_by, speed=lay.speed,
            rows=[PlacementRow(
                device=r["device"], host=r["host"], port=r["port"], first_layer=r["first"],
                last_layer=r["last"], output=r["output"], weights_bytes=r["weights"],
                kv_bytes=r["kv"], needed_bytes=r["needed"],
                seeded_bytes=r["seed"] if r["cached"] else None, wire_bytes=r["wire"],
                free_bytes=r["free"], free_estimated=r["estimated"],
                headroom_bytes=r["headroom"],
            ) for r in lay.rows],
            idle=[] if full is None else list(dict.fromkeys(
                f"{r['host']}:{r['port']}" for r in lay.rows
                if r["port"] is not None and f"{r['host']}:{r['port']}" not in full.rpc)),
            tolerate=min(server.failover.tolerate, len(cluster.worker_hosts(server)))
            if server is not None and cluster.supervised(server) else 0,
            failover=[FailoverRow(
                lost=list(r.lost), rpc=list(r.rpc),
                placement=None if r.layout is None else
                r.layout.placement.describe(),
                gen_tps=None if r.layout is None or r.layout.speed is None
                else r.layout.speed.gen_tps,
                refusal=r.refusal) for r in mine[1:]],
            failover_seed_bytes=dict(sorted(extra.get(lay.server, {}).items())),
        ))
    return out
