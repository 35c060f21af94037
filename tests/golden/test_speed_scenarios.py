"""The plan's predicted tokens/s for every seed scenario (golden), as a plan prints them once
`bench --sweep` has measured the devices.

The device speeds here are assumptions, not measurements: each device reads its weights at a
rate typical of its kind (READ_GBPS, from the hardware's memory bandwidth less a margin), and
remote devices sit an RTT away (RTT_S). They pin the arithmetic (fit, prediction, the split
placement: auto chooses, the text) for every example inventory; measured figures are the lab's
(docs/benchmarks.md). Update with MESHDEPLOY_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import golden
from support.resolved import run_values
from test_placement_scenarios import GOLDEN, ROOT, SCENARIOS, table

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.sources import HfFile, HfResolved
from meshdeploy.placement import speed
from meshdeploy.placement.tensors import weight_tensors
from meshdeploy.roles.rpc_cache import seeding

# GB/s each device reads weights at during generation, by "host/DEVICE" (an assumption).
READ_GBPS = {
    "node1/CPU": 10, "node2/CPU": 10, "node3/CPU": 10,  # lab hosts: DDR4, two channels
    "master/CPU": 12, "worker1/CPU": 16, "worker2/CPU": 12,  # phones: LPDDR4X/LPDDR5
    "mac/MTL0": 400, "mac/CPU": 60,  # M4 Max: 546 GB/s to Metal
    "m4max/MTL0": 400, "macmini/MTL0": 90,  # a Mac mini M4: 120 GB/s
    "box11/CUDA0": 350, "box16/CUDA0": 220,  # an 11 GB and a 16 GB card
}
RTT_S = {"android-cpu-mesh": 0.005}  # Wi-Fi; the others a wired LAN or Thunderbolt
LAN_RTT_S = 0.0005
MEASURED_AT = "2026-11-26T12:00:00+00:00"


def speeds_for(cluster, headers) -> dict:
    server = cluster.servers[0]
    devs = cluster.server_devices(server)
    labels = [label for label, *_ in devs]
    per_byte = [1 / (READ_GBPS[f"{host.name}/{dev}"] * 1e9) for _, host, dev, _ in devs]
    rtt = [0.0 if endpoint is None or endpoint.host.name == server.host
           else RTT_S.get(cluster.name, LAN_RTT_S) for _, _, _, endpoint in devs]
    header = headers[cluster.models[server.model].source.repo]
    cal = speed.Calibration(tuple(labels), "c" * 40, speed.model_key(weight_tensors(header)),
                            speed.Fit(tuple(per_byte)), None, len(labels) + 1, tuple(rtt),
                            MEASURED_AT)
    return {server.name: cal.to_json()}


def planned(path: Path, facts: dict, headers):
    cluster = load_cluster(path)
    resolved = run_values(commit="c" * 40, models={
        name: HfResolved(m.source.repo, "c" * 40,
                         (HfFile(m.source.files[0], 1, f"{i:064x}", "u"),))
        for i, (name, m) in enumerate(cluster.models.items())})
    return seeding.prepare(cluster, cluster.hosts, facts, resolved,
                           speeds=speeds_for(cluster, headers))


def variants():
    """Every example inventory as it is, and the lab's with placement: auto."""
    out = [(name, None) for name in sorted(SCENARIOS)]
    return out + [("lab", "auto")]


@pytest.mark.parametrize("name, placement", variants())
def test_predicted_speed_golden(name, placement, headers, tmp_path):
    path = ROOT / "inventories" / f"{name}.yaml"
    if placement:
        text = path.read_text()
        assert "    model: gemma\n" in text
        path = tmp_path / path.name
        path.write_text(text.replace("    model: gemma\n",
                                     f"    model: gemma\n    placement: {placement}\n", 1))
    plan = planned(path, SCENARIOS[name], headers)
    (lay,) = plan.layouts
    assert lay.speed is not None and lay.speed.gen_tps > 0
    out = table(plan) + "\n" + "".join(f"warning: {n}\n" for n in plan.notes)
    golden.check(GOLDEN / f"speed-{name}{'-' + placement if placement else ''}.txt", out)


def test_on_the_lab_auto_keeps_the_even_split_of_equal_hosts(headers):
    # Equal devices: the memory split is already as fast as any; nothing to suggest.
    plan = planned(ROOT / "inventories" / "lab.yaml", SCENARIOS["lab"], headers)
    assert not any("would split" in n for n in plan.notes), plan.notes
