"""How fast a placement generates: a cost model of llama.cpp's RPC layer split, fitted to
measured splits, and the split it predicts to be fastest within each device's memory.

Generating one token runs the layers in order, device after device (the split is a pipeline
with one token in it), and every device reads all of its weights once per token: generation
is bound by how fast each device reads its bytes. So the model is linear in the bytes each
device holds:

    seconds per token = sum over devices d of bytes_d * per_byte_d
                        + sum over remote devices that hold layers of ROUND_TRIPS * rtt_d

per_byte_d (the inverse of the device's effective read rate for this model's tensor types) is
fitted by least squares, never negative, to the seconds per token bench measured at several
splits (`meshdeploy bench --sweep`). There is no constant term: every split of one model puts
the same total bytes on the devices, so a constant (sampling, the input layer, scheduling)
cannot be told apart from the per-byte times and is carried by them, which is exact for the
model it was measured on; a calibration is never used for another model (model_key()).
Prompt processing is fitted the same way with its own figures.

ROUND_TRIPS is what llama.cpp's RPC backend spends per device per token in the lab pin's tree
(b11312, ggml-rpc.cpp): the input activations set (set_tensor), the graph computed
(graph_compute), the output read back (get_tensor). A device that holds no layer costs no
round trip (the scheduler gives it no split).
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

ROUND_TRIPS = 3


@dataclass(frozen=True)
class Point:
    """One measured split: the weight bytes each device held (in device order), and the seconds
    per token bench measured for generation (gen) and prompt processing (prompt)."""

    bytes: tuple[int, ...]
    gen: float
    prompt: float | None = None


@dataclass(frozen=True)
class Fit:
    """seconds per token = sum(bytes_d * per_byte_d) + hops (see the module)."""

    per_byte: tuple[float, ...]

    def seconds(self, held: tuple[int, ...], rtt: tuple[float, ...] = ()) -> float:
        return sum(b * s for b, s in zip(held, self.per_byte)) + hops(held, rtt)


@dataclass(frozen=True)
class Calibration:
    """A server's fitted speeds, with what they were measured on: its devices (labels, in
    device order, as Cluster.server_devices gives them), the build's commit and the model
    (model_key()). Stale when any of those changes."""

    devices: tuple[str, ...]
    commit: str
    model: str
    gen: Fit
    prompt: Fit | None
    points: int
    rtt: tuple[float, ...] = ()
    measured_at: str = ""  # ISO 8601, UTC
    # The fit's own error: the median of |predicted - measured| / measured over the points,
    # each predicted from a fit of the others (0 with too few points to leave one out).
    error: float = 0.0
    # The model measured on the orchestrator alone, without workers, by the same sweep:
    # generation tokens/s (None where it was not: it did not fit, or failed).
    alone_gen: float | None = None

    def matches(self, devices, commit: str, model: str) -> bool:
        return (tuple(devices), commit, model) == (self.devices, self.commit,
                                                          self.model)

    def gen_rate(self, held: tuple[int, ...]) -> float:
        """Predicted generation tokens per second of a split holding `held` bytes per device."""
        return rate(self.gen.seconds(held, self.rtt))

    def prompt_rate(self, held: tuple[int, ...]) -> float | None:
        """Predicted prompt tokens per second (round trips are paid per batch: left out)."""
        return None if self.prompt is None else rate(self.prompt.seconds(held))

    def to_json(self) -> dict:
        return {"devices": list(self.devices), "commit": self.commit,
                "model": self.model, "points": self.points, "rtt": list(self.rtt),
                "measured_at": self.measured_at, "held_out_error": self.error,
                "gen": list(self.gen.per_byte),
                "prompt": None if self.prompt is None else list(self.prompt.per_byte),
                "alone": None if self.alone_gen is None else {"gen": self.alone_gen}}

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        def fit(d):
            return None if d is None else Fit(tuple(float(v) for v in d))
        return cls(tuple(data["devices"]), str(data["commit"]), str(data["model"]),
                   fit(data["gen"]), fit(data.get("prompt")), int(data["points"]),
                   tuple(float(v) for v in data.get("rtt", ())), str(data.get("measured_at", "")),
                   float(data.get("held_out_error", 0.0)),
                   _alone(data.get("alone")))


def _alone(data) -> float | None:
    try:
        gen = float(data["gen"])
    except (KeyError, TypeError, ValueError):
        return None
    return gen if gen > 0 else None


def model_key(tensors) -> str:
    """What a calibration holds for: the model's weight tensors (names, offsets, sizes), so a
    re-quantised or other model never uses another's speeds, and a copy of the same file does."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.name}\0{t.offset}\0{t.size}\n".encode())
    return h.hexdigest()[:16]


# A fit may give a device no time at all (a device the splits hardly moved): a split on such
# devices alone is predicted at this many seconds per token at least, never infinitely fast.
FLOOR = 1e-4


def rate(seconds: float) -> float:
    """Tokens per second of `seconds` per token (FLOOR at least)."""
    return 1.0 / max(seconds, FLOOR)


def hops(held: tuple[int, ...], rtt: tuple[float, ...]) -> float:
    """Round trips of the devices that hold bytes (rtt 0 or absent: a local device)."""
    return sum(ROUND_TRIPS * r for b, r in zip(held, rtt) if b > 0)


def nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min |a x - y| with x >= 0 (Lawson and Hanson's active set, small problems only)."""
    import numpy as np  # only bench fits: a plan's start does without it

    n = a.shape[1]
    x = np.zeros(n)
    free: list[int] = []
    for _ in range(3 * n + 3):
        gradient = a.T @ (y - a @ x)
        candidates = [j for j in range(n) if j not in free and gradient[j] > 1e-12]
        if not candidates:
            break
        free.append(max(candidates, key=lambda j: gradient[j]))
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], y, rcond=None)[0]
            if all(z[j] > 0 for j in free):
                x = z
                break
            # Step toward z until a variable reaches zero, and drop it (and any other that
            # the step brought to zero): every pass of this loop frees one variable at least.
            steps = {j: x[j] / (x[j] - z[j]) for j in free if z[j] <= 0 and x[j] != z[j]}
            first = min(steps, key=steps.get) if steps else \
                next(j for j in free if z[j] <= 0)
            x = x + (steps[first] if steps else 0.0) * (z - x)
            x[first] = 0.0
            free = [j for j in free if j != first and x[j] > 1e-15]
            if not free:
                break
    return x


def fit(points: list[Point], rtt: tuple[float, ...] = (), which: str = "gen") -> Fit:
    """The Fit of `points` for generation ("gen") or prompt processing ("prompt").

    Byte counts are scaled to GB inside, so the columns are of one size. Needs as many points
    as devices, at splits that differ; ValueError otherwise."""
    if not points:
        raise ValueError("no measured splits")
    n = len(points[0].bytes)
    if any(len(p.bytes) != n for p in points):
        raise ValueError("every point needs one byte count per device")
    ys = [getattr(p, which) for p in points]
    if any(y is None or y <= 0 for y in ys):
        raise ValueError(f"every point needs a positive {which} time")
    if len(points) < n:
        raise ValueError(f"{len(points)} splits measured for {n} devices: at least {n} "
                         "are needed")
    import numpy as np

    gb = 1e9
    a = np.array([[b / gb for b in p.bytes] for p in points])
    if np.linalg.matrix_rank(a) < n:
        raise ValueError("the measured splits do not tell the devices apart: vary them more")
    # A prompt's round trips are paid once per batch of hundreds of tokens, not per token.
    y = np.array([t - (hops(p.bytes, rtt) if which == "gen" else 0)
                  for t, p in zip(ys, points)])
    x = nonneg_lstsq(a, y)
    return Fit(tuple(float(v) / gb for v in x))


def calibrate(devices, commit: str, model: str, points: list[Point],
              rtt: tuple[float, ...] = (), measured_at: str = "") -> Calibration:
    prompt = fit(points, rtt, "prompt") if all(p.prompt for p in points) else None
    return Calibration(tuple(devices), commit, model, fit(points, rtt, "gen"), prompt,
                       len(points), tuple(rtt), measured_at, held_out_error(points, rtt))


def held_out_error(points: list[Point], rtt: tuple[float, ...] = ()) -> float:
    """The median relative error of each point's generation time predicted from a fit of the
    others; 0.0 where leaving one out leaves too few points (or splits too alike) to fit."""
    errors = []
    for i, p in enumerate(points):
        try:
            other = fit(points[:i] + points[i + 1:], rtt)
        except ValueError:
            return 0.0
        errors.append(abs(max(other.seconds(p.bytes, rtt), FLOOR) - p.gen) / p.gen)
    return statistics.median(errors) if errors else 0.0


def held_bytes(placement, shape: dict) -> tuple[int, ...]:
    """Weight bytes each device of `placement` reads per token (its layers, and the output)."""
    out = []
    for i in range(len(placement.devices)):
        held = sum(shape["layer_bytes"][il] for il in placement.layers_of(i))
        if placement.output_device == i:
            held += shape["output_device_bytes"]
        out.append(held)
    return tuple(out)


def fastest_counts(cal: Calibration, shape: dict, kv_layer: list[int],
                   capacity: list[int]) -> list[int] | None:
    """-ts layer counts that the model predicts fastest, or None when no split fits.

    + capacity: bytes each device may give this server's layers, KV and output (its usable
      memory less the compute headroom, and less any budget the user keeps free)
    The output's slot goes to the last device with layers, as llama.cpp's split does. Every
    subset of devices is tried (a device left out saves its round trips); within one, layers
    go to the device with the lowest per-byte time first. Device order is llama.cpp's, so a
    count vector is all a split is: place(n, devices, counts) lands the layers exactly."""
    n_layers, n_dev = shape["n_layers"], len(cal.devices)
    weights = list(shape["layer_bytes"])
    cost = [w + k for w, k in zip(weights, kv_layer)]
    output = shape["output_device_bytes"]
    mean = max(sum(cost) / max(n_layers, 1), 1)
    best: tuple[float, list[int]] | None = None
    for mask in range(1, 1 << n_dev):
        chosen = [d for d in range(n_dev) if mask >> d & 1]
        last = chosen[-1]  # takes the output layer
        counts = [0] * n_dev
        left = n_layers
        # Fill by the mean layer's cost (layers are near uniform), then check exactly below.
        for d in sorted(chosen, key=lambda d: (cal.gen.per_byte[d], d)):
            room = capacity[d] - (output if d == last else 0)
            k = min(left, max(int(room // mean), 0))
            counts[d], left = k, left - k
        if left or any(counts[d] == 0 for d in chosen if d != last):
            continue  # does not fit, or a device would sit idle (a smaller subset has that)
        need = _by_counts(counts, cost, output, last)
        if any(need[d] > capacity[d] for d in chosen):
            continue
        seconds = cal.gen.seconds(_by_counts(counts, weights, output, last), cal.rtt)
        if best is None or seconds < best[0] - 1e-12:
            counts[last] += 1  # the output layer's slot of llama.cpp's split
            best = (seconds, counts)
    return None if best is None else best[1]


def _by_counts(counts: list[int], per_layer: list[int], output: int, last: int) -> tuple:
    """Per device: the sum of per_layer over its layers (in order), plus output on `last`."""
    out, il = [], 0
    for d, k in enumerate(counts):
        out.append(sum(per_layer[il:il + k]) + (output if d == last else 0))
        il += k
    return tuple(out)
