"""Which layers llama-server puts on which device, reproduced from llama.cpp's own arithmetic.

From src/llama-model.cpp, llama_model_base::load_tensors (tree b11312), layer split mode:

    splits[i] = tensor_split[i]            (or each device's free memory when all are zero)
    splits    = cumulative sums / total    (float32 throughout)
    i_gpu_start    = max(n_layer + 1 - n_gpu_layers, 0)
    act_gpu_layers = min(n_gpu_layers, n_layer + 1)
    layer il (0 <= il <= n_layer; il == n_layer is the output layer) goes to the CPU when
    il < i_gpu_start, else to devices[upper_bound(splits, float(il - i_gpu_start) / act_gpu_layers)]

so with every layer offloaded the divisor is n_layer + 1, not n_layer: the output layer takes a
slot of the split. The input layer (token_embd) always stays on the orchestrator's CPU; a model
without output.weight loads a second copy of token_embd on the output layer's device.
Device order (src/llama.cpp): RPC devices first in --rpc order, then local GPUs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshdeploy.config.model import MAX_TENSOR_SPLIT
from meshdeploy.placement import defaults as d

if TYPE_CHECKING:  # annotations only: the header reader (urllib, ssl) is not loaded with it
    from meshdeploy.placement.tensors import Tensor

CPU = -1
_FLOAT32 = struct.Struct("<f")


def f32(x: float) -> float:
    """`x` rounded to the nearest float32. One addition or division of two float32 values, done
    in double precision and rounded once, is float32's own result (double carries more than
    twice float32's bits), so this reproduces llama.cpp's float arithmetic."""
    return _FLOAT32.unpack(_FLOAT32.pack(x))[0]


@dataclass(frozen=True)
class Placement:
    devices: tuple[str, ...]
    n_layers: int
    layer_device: tuple[int, ...]  # device index of blk.0 .. blk.{n-1}; CPU (-1) = not offloaded
    output_device: int
    split: tuple[float, ...]  # llama.cpp's normalised cumulative split points

    def layers_of(self, device: int) -> list[int]:
        return [il for il, dev in enumerate(self.layer_device) if dev == device]

    def describe(self) -> str:
        """"RPC0: layers 0-14; RPC1: layers 15-30; MTL0: layers 31-46 + output"."""
        parts = []
        for i, name in [(CPU, "CPU")] + list(enumerate(self.devices)):
            layers = self.layers_of(i)
            text = f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else \
                (f"layer {layers[0]}" if layers else "")
            if self.output_device == i:
                text = f"{text} + output" if text else "output"
            if text:
                parts.append(f"{name}: {text}")
        return "; ".join(parts)


def split_points(weights) -> tuple[float, ...]:
    """Cumulative, normalised split points, rounded as llama.cpp's float arithmetic rounds them."""
    total = 0.0
    cumulative = []
    for w in weights:
        total = f32(total + f32(w))
        cumulative.append(total)
    if total <= 0:
        raise ValueError("the split is all zero: give at least one device a positive share")
    return tuple(f32(c / total) for c in cumulative)


def place(n_layers: int, devices: list[str], tensor_split=None, free_bytes=None,
          n_gpu_layers: int | None = None) -> Placement:
    """llama.cpp's layer assignment.

    + devices: names in -ts order (RPC devices in --rpc order, then local GPUs), e.g.
      ["RPC0", "RPC1", "MTL0"]
    + tensor_split: -ts values (missing ones are 0, as llama.cpp pads them); when absent or all
      zero, free_bytes (one per device, what each device reports) decides
    + n_gpu_layers: -ngl; None or negative = all layers and the output
    Example: place(24, ["RPC0", "RPC1"], [0.5, 0.5]).describe() ==
             "RPC0: layers 0-12; RPC1: layers 13-23 + output"
    """
    if n_layers < 1:
        raise ValueError(f"n_layers must be at least 1, got {n_layers}")
    if not devices:
        return Placement((), n_layers, (CPU,) * n_layers, CPU, ())
    n_dev = len(devices)
    if tensor_split is not None:
        values = [float(v) for v in tensor_split]
        if len(values) > MAX_TENSOR_SPLIT:
            raise ValueError(f"tensor split has {len(values)} values; llama-server takes at most "
                             f"{MAX_TENSOR_SPLIT}")
        if len(values) > n_dev:
            raise ValueError(f"tensor split has {len(values)} values for {n_dev} devices "
                             f"({', '.join(devices)}); llama.cpp would ignore the extra ones")
        if any(v < 0 for v in values):
            raise ValueError(f"tensor split values must not be negative: {values}")
        values += [0.0] * (n_dev - len(values))
    if tensor_split is None or all(v == 0 for v in values):
        if free_bytes is None or len(free_bytes) != n_dev:
            raise ValueError(f"without a tensor split, free memory of each of the {n_dev} devices "
                             "decides the split: give free_bytes, one per device")
        values = [float(v) for v in free_bytes]
    split = split_points(values)
    ngl = n_layers + 1 if n_gpu_layers is None or n_gpu_layers < 0 else n_gpu_layers
    start = max(n_layers + 1 - ngl, 0)
    active = min(ngl, n_layers + 1)

    def device_of(il: int) -> int:
        if il < start or il - start >= active:
            return CPU
        x = f32(f32(il - start) / f32(active))
        return next(i for i, s in enumerate(split) if s > x)  # std::upper_bound

    return Placement(tuple(devices), n_layers, tuple(device_of(il) for il in range(n_layers)),
                     device_of(n_layers), tuple(float(s) for s in split))


def device_tensors(placement: Placement, tensors: list[Tensor], device: int) -> list[Tensor]:
    """Tensors whose bytes llama-server sends to `device` (seeding them makes its load free)."""
    out = []
    has_output = any(t.name == "output.weight" for t in tensors)
    for t in tensors:
        if t.layer is not None:
            if t.layer < placement.n_layers and placement.layer_device[t.layer] == device:
                out.append(t)
        elif t.is_input:
            if t.name == "token_embd.weight" and not has_output and placement.output_device == device:
                out.append(t)  # tied embeddings: the output layer's own copy
        elif placement.output_device == device:
            out.append(t)
    return out


def wire_bytes(tensors: list[Tensor]) -> tuple[int, int]:
    """(bytes a seeded cache saves, bytes that still cross the network at every load)."""
    hashed = sum(t.size for t in tensors if t.hashed)
    return hashed, sum(t.size for t in tensors) - hashed


@dataclass(frozen=True)
class DeviceFit:
    device: str
    layers: int
    weights: int  # bytes of its layers' tensors (+ output tensors when it holds the output)
    kv: int
    headroom: int
    free: int

    @property
    def needed(self) -> int:
        return self.weights + self.kv + self.headroom

    @property
    def ok(self) -> bool:
        return self.needed <= self.free

    def line(self) -> str:
        return (f"{self.device}: {self.layers} layers need {self.needed / 1e9:.2f} GB "
                f"(weights {self.weights / 1e9:.2f}, KV {self.kv / 1e9:.2f}, compute "
                f"{self.headroom / 1e9:.2f}), {self.free / 1e9:.2f} GB free")


def fits(placement: Placement, shape: dict, kv_layer: list[int], free_bytes,
         headroom: int = d.placement_compute_headroom_bytes) -> list[DeviceFit]:
    """Per device: what the placement puts there against what it has free.

    + shape: tensors.model_shape(); kv_layer: KV bytes per layer (kvcache.layer_bytes)
    """
    if len(free_bytes) != len(placement.devices):
        raise ValueError(f"free_bytes has {len(free_bytes)} values for "
                         f"{len(placement.devices)} devices")
    out = []
    for i, name in enumerate(placement.devices):
        layers = placement.layers_of(i)
        weights = sum(shape["layer_bytes"][il] for il in layers)
        if placement.output_device == i:
            weights += shape["output_device_bytes"]
        kv = sum(kv_layer[il] for il in layers)
        used = bool(layers) or placement.output_device == i
        out.append(DeviceFit(name, len(layers), weights, kv, headroom if used else 0,
                             int(free_bytes[i])))
    return out


def refusal(device_fits: list[DeviceFit]) -> str | None:
    """One message naming every device that is short, or None when all fit."""
    short = [f for f in device_fits if not f.ok]
    if not short:
        return None
    return "the model does not fit: " + "; ".join(f.line() for f in short)


def auto_split(free_bytes, shape: dict, kv_layer: list[int],
               headroom: int = d.placement_compute_headroom_bytes) -> list[int]:
    """-ts values that share the layers in proportion to each device's usable memory.

    Usable = free - compute headroom (- the output layer on the device that takes it); a layer
    costs its weights plus its KV (kv_layer[il]), so shares are cut by cumulative cost, not by count.
    The values are layer counts (the output's slot included), which llama.cpp's float split
    reproduces exactly: place(n, devices, auto_split(...)) lands every layer where computed.
    Check the result with fits(); this never promises that the model fits.
    """
    n = shape["n_layers"]
    n_dev = len(free_bytes)
    if n_dev == 0:
        raise ValueError("auto_split needs at least one device")
    usable = [max(int(f) - headroom, 0) for f in free_bytes]
    # The output goes to the last device with a share: the last one that can hold it.
    out_dev = next((j for j in range(n_dev - 1, -1, -1)
                    if usable[j] >= shape["output_device_bytes"]), n_dev - 1)
    usable = [u if i <= out_dev else 0 for i, u in enumerate(usable)]
    usable[out_dev] = max(usable[out_dev] - shape["output_device_bytes"], 0)
    if sum(usable) == 0:
        usable = [1 if i <= out_dev else 0 for i in range(n_dev)]
    cost = [shape["layer_bytes"][il] + kv_layer[il]
            for il in range(n)]
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    total_usable = sum(usable)
    bounds, acc, lo = [], 0, 0
    for i in range(out_dev):
        acc += usable[i]
        target = prefix[-1] * acc / total_usable
        # The layer boundary whose cumulative cost is nearest the device's share.
        m = min(range(lo, n + 1), key=lambda k: (abs(prefix[k] - target), k))
        bounds.append(m)
        lo = m
    bounds.append(n)
    counts, prev = [], 0
    for b in bounds:
        counts.append(b - prev)
        prev = b
    counts[out_dev] += 1  # the output layer's slot
    return counts + [0] * (n_dev - out_dev - 1)
