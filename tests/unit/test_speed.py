"""The speed model (placement.speed): fitting measured splits, the fastest split within
memory, and placement: auto in the plan (layout, -ts in llama-server's unit)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.device_facts import cpu
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.sources import HfFile, HfResolved
from meshdeploy.placement import layout, speed
from meshdeploy.placement.layers import place
from meshdeploy.roles.rpc_cache import seeding
from meshdeploy.views.plan import render_placement

ROOT = Path(__file__).resolve().parents[2]
MB = 1_000_000
SHAPE = {"n_layers": 24, "layer_bytes": [80 * MB] * 24, "output_device_bytes": 200 * MB}
KV = [MB] * 24
ROOM = 10**12  # memory that holds anything


def measured(per_byte, splits, rtt=(), noise=()):
    """Points a device of `per_byte` seconds per byte would give at `splits` (-ts values)."""
    truth = speed.Fit(tuple(per_byte))
    out = []
    for i, ts in enumerate(splits):
        held = speed.held_bytes(place(24, ["a", "b"][:len(ts)], ts), SHAPE)
        t = truth.seconds(held, rtt) * (1 + (noise[i] if noise else 0))
        out.append(speed.Point(held, t, truth.seconds(held) / 8))
    return out


SPLITS = ([12, 13], [6, 19], [18, 7], [3, 22], [22, 3])


def test_the_fit_gives_back_the_speeds_that_made_the_points():
    points = measured((2e-11, 6e-11), SPLITS, rtt=(0.0005, 0.0005))
    fit = speed.fit(points, (0.0005, 0.0005))
    assert fit.per_byte == pytest.approx((2e-11, 6e-11), rel=1e-6)
    assert speed.fit(points, (0.0005, 0.0005), "prompt").per_byte == \
        pytest.approx((2e-11 / 8, 6e-11 / 8), rel=1e-6)
    # With 3% noise the fit still orders the devices and lands near.
    noisy = speed.fit(measured((2e-11, 6e-11), SPLITS, noise=(0.03, -0.03, 0.02, -0.01, 0.0)))
    assert noisy.per_byte[0] == pytest.approx(2e-11, rel=0.15)
    assert noisy.per_byte[1] == pytest.approx(6e-11, rel=0.15)


def test_a_device_is_never_fitted_faster_than_free():
    # The second device's time shrinks as it holds more: least squares would call it negative.
    points = [speed.Point((1000 * MB, 100 * MB), 0.05), speed.Point((600 * MB, 500 * MB), 0.028),
              speed.Point((200 * MB, 900 * MB), 0.004)]
    unconstrained = np.linalg.lstsq(
        np.array([[b / 1e9 for b in p.bytes] for p in points]),
        np.array([p.gen for p in points]), rcond=None)[0]
    assert unconstrained[1] < 0  # what the constraint is there for
    fit = speed.fit(points)
    assert fit.per_byte[1] == 0 and fit.per_byte[0] > 0


@pytest.mark.parametrize("points, message", [
    ([], "no measured splits"),
    ([speed.Point((1, 2), 0.1)], "1 splits measured for 2 devices"),
    ([speed.Point((1, 2), 0.1), speed.Point((2, 4), 0.2)], "do not tell the devices apart"),
    ([speed.Point((1, 2), 0.1), speed.Point((2, 1), 0)], "positive gen time"),
])
def test_too_little_to_fit_is_refused(points, message):
    with pytest.raises(ValueError, match=message):
        speed.fit(points)


def cal(per_byte, rtt=(), devices=("a", "b")):
    return speed.Calibration(tuple(devices), "c" * 40, "m", speed.Fit(tuple(per_byte)), None,
                             5, tuple(rtt), "2026-11-26T23:00:00+00:00")


def test_the_faster_device_gets_the_layers_its_memory_holds():
    fast_a = cal((2e-11, 6e-11))
    assert speed.fastest_counts(fast_a, SHAPE, KV, [ROOM, ROOM]) == [25, 0]
    # a holds 12 layers of 81 MB; b takes the rest and the output's slot.
    counts = speed.fastest_counts(fast_a, SHAPE, KV, [1000 * MB, ROOM])
    assert counts == [12, 13]
    p = place(24, ["a", "b"], counts)
    assert (len(p.layers_of(0)), len(p.layers_of(1)), p.output_device) == (12, 12, 1)
    # The other way round the output goes with the layers to b.
    assert speed.fastest_counts(cal((6e-11, 2e-11)), SHAPE, KV, [ROOM, ROOM]) == [0, 25]
    # Nothing fits in 1 GB each: 24 x 81 MB + 200 MB of output is 2.14 GB.
    assert speed.fastest_counts(fast_a, SHAPE, KV, [1000 * MB, 1000 * MB]) is None


def test_a_far_device_is_left_out_when_its_round_trips_cost_more_than_its_speed_saves():
    # b is a bit faster per byte but 20 ms away; a is local (rtt 0).
    near = cal((2.0e-11, 1.9e-11), rtt=(0.0, 0.020))
    assert speed.fastest_counts(near, SHAPE, KV, [ROOM, ROOM]) == [25, 0]
    close = cal((2.0e-11, 1.0e-11), rtt=(0.0, 0.0001))
    assert speed.fastest_counts(close, SHAPE, KV, [ROOM, ROOM]) == [0, 25]


def test_a_calibration_survives_json_and_knows_what_it_holds_for():
    c = speed.calibrate(["a", "b"], "c" * 40, "m", measured((2e-11, 6e-11), SPLITS),
                        measured_at="2026-11-26T23:00:00+00:00")
    back = speed.Calibration.from_json(c.to_json())
    assert back == c
    assert back.matches(["a", "b"], "c" * 40, "m")
    assert not back.matches(["a", "b"], "d" * 40, "m")


# --- in the plan --------------------------------------------------------------------------------

LAB = {"node1": cpu(25_183_293_440, 22_800_000_000), "node2": cpu(25_183_293_440, 22_800_000_000),
       "node3": cpu(25_183_293_440, 22_800_000_000)}
COMMIT = "c" * 40


def lab_plan(tmp_path, placement: str, speeds: dict, commit=COMMIT, keep_free_gb=None):
    text = (ROOT / "inventories" / "lab.yaml").read_text()
    if keep_free_gb is not None:
        node2 = "  node2:\n    address: 10.200.0.12\n"
        assert node2 in text
        text = text.replace(node2, f"{node2}    keep_free_gb: {keep_free_gb}\n")
    text = text.replace("    model: gemma\n", f"    model: gemma\n    placement: {placement}\n", 1)
    assert f"placement: {placement}" in text
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    cluster = load_cluster(path)
    resolved = run_values(commit=commit, models={
        name: HfResolved(m.source.repo, "c" * 40, (HfFile(m.source.files[0], 1, f"{i:064x}", "u"),))
        for i, (name, m) in enumerate(cluster.models.items())})
    return cluster, seeding.prepare(cluster, cluster.hosts, LAB, resolved, speeds=speeds)


def lab_speeds(tmp_path, per_byte, commit=COMMIT, rtt=()) -> dict:
    """A kept calibration for the lab's gemma server, as bench --sweep keeps it."""
    cluster, planned = lab_plan(tmp_path, "memory", {})
    (lay,) = planned.layouts
    devices = [label for label, *_ in cluster.server_devices(cluster.servers[0])]
    tensors = [t for row in lay.rows for t in row["tensors"]]
    key = speed.model_key(sorted(tensors, key=lambda t: t.offset))
    return {"main": speed.Calibration(tuple(devices), commit, key, speed.Fit(tuple(per_byte)),
                                      speed.Fit(tuple(v / 8 for v in per_byte)), 7, tuple(rtt),
                                      "2026-11-26T23:00:00+00:00").to_json()}


def test_placement_auto_without_a_measurement_splits_by_memory_and_says_so(tmp_path, headers):
    _, planned = lab_plan(tmp_path, "auto", {})
    (lay,) = planned.layouts
    assert lay.split_by == "memory" and lay.split is None and planned.splits == {}
    assert any("placement auto splits by memory: no device speeds are measured" in n
               for n in planned.notes), planned.notes


def test_placement_auto_gives_the_faster_worker_the_layers(tmp_path, headers):
    speeds = lab_speeds(tmp_path, (9e-10, 3e-10))  # node3's rpc-server 3x node2's speed
    _, memory = lab_plan(tmp_path, "memory", speeds)
    _, auto = lab_plan(tmp_path, "auto", speeds)
    (before,), (after,) = memory.layouts, auto.layouts
    assert after.split_by == "speed" and auto.splits == {"main": after.split}
    layers = [len(after.placement.layers_of(i)) for i in range(2)]
    memory_layers = [len(before.placement.layers_of(i)) for i in range(2)]
    assert layers[1] > memory_layers[1] and layers[0] < memory_layers[0]
    assert after.speed.gen_tps > after.speed.memory_gen_tps
    assert before.speed.gen_tps == after.speed.memory_gen_tps  # the same memory split
    text = render_placement(layout.sections(auto.layouts))
    assert "(split for speed by placement: auto;" in text
    assert f"Predicted: ~{after.speed.gen_tps:.2f} tok/s generation" in text
    assert f"(split by memory: ~{after.speed.memory_gen_tps:.2f} tok/s generation)" in text
    # Left at memory, the plan says what auto would give.
    assert any("placement: auto would split" in n for n in memory.notes), memory.notes


def test_a_calibration_of_another_build_is_not_used(tmp_path, headers):
    speeds = lab_speeds(tmp_path, (9e-10, 3e-10), commit="d" * 40)
    _, planned = lab_plan(tmp_path, "auto", speeds)
    (lay,) = planned.layouts
    assert lay.split_by == "memory" and lay.speed is None
    assert any("its build changed since the device speeds were measured" in n
               for n in planned.notes), planned.notes


def test_the_chosen_split_is_the_servers_ts(tmp_path, headers):
    from meshdeploy.roles.services import argv as argvs
    from dataclasses import replace

    speeds = lab_speeds(tmp_path, (9e-10, 3e-10))
    cluster, planned = lab_plan(tmp_path, "auto", speeds)
    server = replace(cluster.servers[0],
                     tensor_split=tuple(float(v) for v in planned.splits["main"]))
    argv = argvs.llama_server_argv("/x/llama-server", cluster, server, "/m.gguf")
    ts = argv[argv.index("-ts") + 1]
    assert ts == ",".join(str(v) for v in planned.splits["main"])
    counts = [int(v) for v in ts.split(",")]
    p = place(18, ["a", "b"], counts)
    assert [len(p.layers_of(i)) for i in range(2)] == [c - (i == 1) for i, c in enumerate(counts)]


def test_keep_free_is_left_on_the_device_and_warned_when_a_split_takes_it(tmp_path, headers):
    speeds = lab_speeds(tmp_path, (3e-10, 9e-10))  # node2 the faster: auto puts all there
    _, alone = lab_plan(tmp_path, "auto", speeds)
    assert [len(alone.layouts[0].placement.layers_of(i)) for i in range(2)] == [18, 0]
    # node2 reports 22.8 GB free: keeping 22.25 GB (and 0.54 of compute) leaves room for a few
    # 4 MB layers and their KV only.
    _, kept = lab_plan(tmp_path, "auto", speeds, keep_free_gb=22.25)
    (lay,) = kept.layouts
    node2 = lay.rows[0]
    assert lay.split_by == "speed" and 0 < len(lay.placement.layers_of(0)) < 18, kept.notes
    assert node2["headroom"] >= 22.25e9 and not lay.placement.output_device == 0
    # The split by memory ignores it: the plan says so.
    _, memory = lab_plan(tmp_path, "memory", speeds, keep_free_gb=22.25)
    assert any("node2:50052/CPU keeps 22.20 GB free, less than its host's keep_free_gb 22.25"
               in n for n in memory.notes), memory.notes


def test_the_fits_own_error_is_what_leaving_each_split_out_misses():
    exact = speed.calibrate(["a", "b"], "c", "m", measured((2e-11, 6e-11), SPLITS))
    assert exact.error == pytest.approx(0, abs=1e-9)
    noise = (0.10, -0.10, 0.10, -0.10, 0.10)
    noisy = speed.calibrate(["a", "b"], "c", "m", measured((2e-11, 6e-11), SPLITS, noise=noise))
    assert 0.05 < noisy.error < 0.4
    assert speed.Calibration.from_json(noisy.to_json()).error == noisy.error
    # Two splits for two devices: none can be left out.
    assert speed.held_out_error(measured((2e-11, 6e-11), SPLITS[:2])) == 0.0


def test_a_device_fitted_at_no_time_is_never_infinitely_fast():
    c = cal((0.0, 6e-11))
    assert c.gen_rate((1000 * MB, 0)) == 1 / speed.FLOOR


def test_auto_keeps_the_memory_split_when_the_gain_is_within_the_fits_error(tmp_path, headers):
    speeds = lab_speeds(tmp_path, (9e-10, 3e-10))
    _, sure = lab_plan(tmp_path, "auto", speeds)
    assert sure.layouts[0].split_by == "speed"
    speeds["main"]["held_out_error"] = 5.0  # the measurements told nothing apart
    _, unsure = lab_plan(tmp_path, "auto", speeds)
    assert unsure.layouts[0].split_by == "memory"
    assert any("the measured speeds' own error: 500%" in n for n in unsure.notes), unsure.notes


def test_the_nonnegative_fit_meets_its_optimality_conditions():
    # Karush-Kuhn-Tucker for min |a x - y|, x >= 0: the gradient a'(y - a x) is 0 where x > 0
    # and never positive where x = 0; checked on random problems of the fit's sizes.
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 6))
        a, y = rng.random((int(rng.integers(n, 10)), n)), rng.normal(size=10)
        y = y[:a.shape[0]]
        x = speed.nonneg_lstsq(a, y)
        gradient = a.T @ (y - a @ x)
        assert (x >= 0).all()
        assert all(abs(g) < 1e-8 if v > 0 else g < 1e-8 for g, v in zip(gradient, x))


def test_a_much_slower_device_is_named_while_the_split_ignores_it(tmp_path, headers):
    speeds = lab_speeds(tmp_path, (9e-10, 3e-10))
    _, memory = lab_plan(tmp_path, "memory", speeds)
    assert "servers.main: node2:50052/CPU generates 3.0x slower per GB of weights than " \
           "node3:50052/CPU, and the split by memory does not know it (placement: auto does)" \
        in memory.notes, memory.notes
    _, auto = lab_plan(tmp_path, "auto", speeds)
    assert not any("slower per GB" in n for n in auto.notes), auto.notes
    _, alike = lab_plan(tmp_path, "memory", lab_speeds(tmp_path, (4e-10, 3e-10)))
    assert not any("slower per GB" in n for n in alike.notes), alike.notes


def test_the_plan_says_when_another_orchestrator_would_be_faster(tmp_path, headers):
    """node2 is fast but 30 ms away, node3 slow and near: from node1 the best split pays
    node2's round trips every token; served from node2 they go."""
    far = lab_speeds(tmp_path, (3e-10, 9e-10), rtt=(0.03, 0.0005))
    _, planned = lab_plan(tmp_path, "auto", far)
    (note,) = [n for n in planned.notes if "serving it from" in n]
    (lay,) = planned.layouts
    assert note.startswith("servers.main: serving it from node2 would give ~")
    assert f"(from node1: ~{lay.speed.gen_tps:.2f} at best): node2's round trips of 30.0 ms go" \
        in note
    assert lay.speed.rtt_ms == [30.0, 0.5]  # plan --json carries the round trips
    there = float(note.split("~")[1].split()[0])
    assert there > 1.5 * lay.speed.gen_tps
    # Near, the same speeds move nothing.
    _, near = lab_plan(tmp_path, "auto", lab_speeds(tmp_path, (3e-10, 9e-10),
                                                    rtt=(0.0005, 0.0005)))
    assert not any("serving it from" in n for n in near.notes), near.notes



def test_the_orchestrator_measured_alone_is_weighed_against_the_split(tmp_path, headers):
    """bench --sweep also runs the model on node1 alone (as --compare-local does): where that
    was faster than the split the plan keeps, the plan says so with both figures."""
    speeds = lab_speeds(tmp_path, (9e-10, 3e-10))
    speeds["main"]["alone"] = {"gen": 60.0, "prompt": 500.0}
    cal = speed.Calibration.from_json(speeds["main"])
    assert cal.alone_gen == 60.0 and cal.to_json()["alone"] == {"gen": 60.0}
    for placement in ("memory", "auto"):
        _, planned = lab_plan(tmp_path, placement, speeds)
        (lay,) = planned.layouts
        (note,) = [n for n in planned.notes if "alone" in n]
        assert lay.speed.alone_gen_tps == 60.0
        assert note == ("servers.main: gemma on node1 alone, without workers, generated ~60.00 "
                        "tok/s in bench --sweep (measured 2026-11-26T23:00:00+00:00); this split "
                        f"is predicted at ~{lay.speed.gen_tps:.2f}")
    speeds["main"]["alone"] = {"gen": 1.0}  # slower alone: nothing to say
    _, planned = lab_plan(tmp_path, "memory", speeds)
    assert not any("alone" in n for n in planned.notes), planned.notes


def test_placement_defaults_to_auto_and_is_quiet_until_speeds_are_measured(tmp_path, headers):
    text = (ROOT / "inventories" / "lab.yaml").read_text()
    assert "placement" not in text
    (tmp_path / "lab.yaml").write_text(text)
    cluster = load_cluster(tmp_path / "lab.yaml")
    assert cluster.servers[0].placement == "auto" and not cluster.servers[0].placement_set
    resolved = run_values(commit=COMMIT, models={
        name: HfResolved(m.source.repo, "c" * 40, (HfFile(m.source.files[0], 1, f"{i:064x}", "u"),))
        for i, (name, m) in enumerate(cluster.models.items())})
    quiet = seeding.prepare(cluster, cluster.hosts, LAB, resolved, speeds={})
    assert quiet.layouts[0].split_by == "memory"
    assert not any("placement" in n for n in quiet.notes), quiet.notes
    measured = seeding.prepare(cluster, cluster.hosts, LAB, resolved,
                               speeds=lab_speeds(tmp_path, (9e-10, 3e-10)))
    assert measured.layouts[0].split_by == "speed"


def test_an_explicit_tensor_split_wins_over_the_default_and_refuses_an_explicit_auto(tmp_path):
    from meshdeploy.errors import ConfigError

    text = (ROOT / "inventories" / "lab.yaml").read_text().replace(
        "    model: gemma\n", "    model: gemma\n    tensor_split: [1, 3]\n", 1)
    (tmp_path / "lab.yaml").write_text(text)
    server = load_cluster(tmp_path / "lab.yaml").servers[0]
    assert server.placement == "memory" and server.tensor_split == (1.0, 3.0)
    (tmp_path / "lab.yaml").write_text(text.replace(
        "    model: gemma\n", "    model: gemma\n    placement: auto\n", 1))
    with pytest.raises(ConfigError) as refused:
        load_cluster(tmp_path / "lab.yaml")
    assert "placement: is auto, which chooses the split itself, but tensor_split is set too" \
        in str(refused.value)
