"""placement reproduces llama.cpp's float32 split arithmetic without numpy (a plan's start does
not import it): the same splits and layers as numpy's float32 scalars give, on random shares,
free-memory byte counts and layer counts, where plain double arithmetic gives other ones."""

from __future__ import annotations

import random

import numpy as np

from meshdeploy.placement import layers as placement
from meshdeploy.placement.layers import CPU, place


def numpy_place(n_layers: int, values: list[float], ngl: int | None = None):
    """llama_model_base::load_tensors' layer split in numpy float32, written independently."""
    total = np.float32(0)
    cumulative = []
    for v in values:
        total = np.float32(total + np.float32(v))
        cumulative.append(total)
    split = [np.float32(c / total) for c in cumulative]
    ngl = n_layers + 1 if ngl is None else ngl
    start, active = max(n_layers + 1 - ngl, 0), min(ngl, n_layers + 1)

    def device(il):
        if il < start or il - start >= active:
            return CPU
        x = np.float32(np.float32(il - start) / np.float32(active))
        return next(i for i, s in enumerate(split) if s > x)

    return [float(s) for s in split], [device(il) for il in range(n_layers + 1)]


def cases(count: int = 3000):
    rng = random.Random(7)
    for _ in range(count):
        n_dev = rng.randint(1, 6)
        kind = rng.choice(("shares", "bytes", "thirds"))
        if kind == "shares":
            values = [rng.choice((0, rng.random(), rng.randint(1, 9) / 10)) for _ in range(n_dev)]
        elif kind == "bytes":
            values = [float(rng.randint(1, 2**40)) for _ in range(n_dev)]
        else:
            values = [1 / 3] * n_dev
        if not any(values):
            values[0] = 1.0
        ngl = rng.choice((None, rng.randint(0, 80)))
        yield rng.randint(1, 80), values, ngl


def test_the_split_and_layers_match_numpy_float32():
    for n_layers, values, ngl in cases():
        devices = [f"RPC{i}" for i in range(len(values))]
        got = place(n_layers, devices, values, n_gpu_layers=ngl)
        split, layers = numpy_place(n_layers, values, ngl)
        assert list(got.split) == split, (n_layers, values, ngl)
        assert list(got.layer_device) + [got.output_device] == layers, (n_layers, values, ngl)


def test_double_arithmetic_would_place_some_layers_elsewhere(monkeypatch):
    """The comparison above can fail: without the float32 rounding, some of the same cases
    come out otherwise."""
    monkeypatch.setattr(placement, "f32", float)
    differ = 0
    for n_layers, values, ngl in cases():
        got = place(n_layers, [f"RPC{i}" for i in range(len(values))], values, n_gpu_layers=ngl)
        split, layers = numpy_place(n_layers, values, ngl)
        differ += list(got.split) != split or list(got.layer_device) + [got.output_device] != layers
    assert differ > 0
