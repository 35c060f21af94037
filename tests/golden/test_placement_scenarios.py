"""The plan's placement table for every seed scenario (golden), and the refusals.

Each inventory is planned against the memory its seed describes (an M4 Max whose Metal reports
55.66 GB, a 16 GiB Mac mini, 11 GB and 16 GB CUDA cards, 8 and 12 GB phones, the lab's hosts),
with the model header from model_headers.py (gemma-3-270m is the real file). A golden change
means llama.cpp would place layers differently, or meshdeploy counts memory differently:
update with MESHDEPLOY_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.device_facts import GB, GiB, cpu, cuda, mac
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.sources import HfFile, HfResolved
from meshdeploy.errors import ConfigError, PlanError
from meshdeploy.placement import layout
from meshdeploy.roles.rpc_cache import seeding
from meshdeploy.views.plan import render_placement

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "plan"


M4MAX = mac(64 * GiB, 55_662_790_000, False, 58 * GB)  # the seed: "M4 Max (55GB)"
MINI = mac(16 * GiB, 11_453_246_122, True, 12 * GB)  # "Mac Mini (12GB)"
LAB_HOST = cpu(25_183_293_440, 22_800_000_000)

SCENARIOS = {
    "lab": {"node1": LAB_HOST, "node2": LAB_HOST, "node3": LAB_HOST},
    "android-cpu-mesh": {"master": cpu(7_600_000_000, 3_400_000_000),
                         "worker1": cpu(11_500_000_000, 6_100_000_000),
                         "worker2": cpu(7_600_000_000, 3_900_000_000)},
    "one-mac-mtl0-cpu": {"mac": M4MAX},
    "two-macs-config-a": {"m4max": M4MAX, "macmini": MINI},
    "two-macs-config-b": {"m4max": M4MAX, "macmini": MINI},
    "two-cuda-11-16": {"box11": cuda(11_500_000_000), "box16": cuda(16_800_000_000)},
}


def plan_placement(path: Path, facts: dict) -> tuple[seeding.SeedPlan, list[str]]:
    cluster = load_cluster(path)
    resolved = run_values(models={
        name: HfResolved(m.source.repo, "c" * 40,
                         (HfFile(m.source.files[0], 1, f"{i:064x}", "u"),))
        for i, (name, m) in enumerate(cluster.models.items())})
    planned = seeding.prepare(cluster, cluster.hosts, facts, resolved)
    return planned, list(planned.notes)


def table(resolved: seeding.SeedPlan, cluster=None) -> str:
    """The placement section as the text plan prints it (with its failover placements where
    the cluster is given)."""
    return render_placement(layout.sections(resolved.layouts, cluster, resolved.runs,
                                            resolved.extra))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_placement_table_golden(name, headers):
    resolved, notes = plan_placement(ROOT / "inventories" / f"{name}.yaml", SCENARIOS[name])
    assert [lay.server for lay in resolved.layouts] == ["main"]
    assert notes == []
    text = table(resolved, load_cluster(ROOT / "inventories" / f"{name}.yaml")) + "\n"
    golden = GOLDEN / f"placement-{name}.txt"
    if os.environ.get("MESHDEPLOY_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with MESHDEPLOY_UPDATE_GOLDEN=1"
    assert text == golden.read_text()


def test_every_row_has_headroom_in_the_seed_scenarios(headers):
    # The seeds ran these clusters: meshdeploy must not call any of them too small.
    for name, facts in SCENARIOS.items():
        resolved, _ = plan_placement(ROOT / "inventories" / f"{name}.yaml", facts)
        for row in resolved.layouts[0].rows:
            assert row["headroom"] is not None and row["headroom"] >= 0, (name, row["device"])


def edited(tmp_path, name: str, old: str, new: str) -> Path:
    text = (ROOT / "inventories" / f"{name}.yaml").read_text()
    assert old in text
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace(old, new))
    return path


def test_a_cluster_that_cannot_fit_is_refused_with_its_numbers(tmp_path, headers):
    # The full 128K context without the sliding-window saving: the 11 GB card's 26 layers
    # need 6.9 GB of weights and 26 x 128K x 16 KV heads x 256 values x 2 bytes of KV.
    path = edited(tmp_path, "two-cuda-11-16", "ctx_size: 32768",
                  'ctx_size: 131072\n    extra_args: ["--swa-full"]')
    with pytest.raises(PlanError) as exc:
        plan_placement(path, SCENARIOS["two-cuda-11-16"])
    msg = exc.value.message
    assert msg.startswith("servers.main: gemma27 does not fit at ctx_size 131072: ")
    assert "box11:50052/CUDA0: layers 0-25 need 35.34 GB (weights 6.89, KV 27.92, " \
           "compute 0.54), 10.95 GB free" in msg
    assert "box16/CUDA0: layers 26-61 + output" in msg
    assert "ctx_size" in exc.value.hint


def test_devices_sharing_a_mac_are_checked_together(tmp_path, headers):
    # On a 16 GiB Mac each rpc-server's half of GLM fits its own device at 4K context, but
    # Metal's working set and the CPU buffers come out of the same 12 GB of RAM.
    path = edited(tmp_path, "one-mac-mtl0-cpu", "n_gpu_layers: 99",
                  "n_gpu_layers: 99\n    ctx_size: 4096")
    facts = {"mac": mac(16 * GiB, 11_453_246_122, True, 12 * GB)}
    with pytest.raises(PlanError) as exc:
        plan_placement(path, facts)
    msg = exc.value.message
    assert "mac: mac:50052/MTL0, mac:50053/CPU share its RAM and need" in msg
    assert "12.00 GB available" in msg
    assert "mac:50052/MTL0: layers" not in msg  # each device alone has room


def test_an_explicit_split_for_more_devices_than_exist_is_refused_at_its_line(tmp_path):
    path = edited(tmp_path, "two-macs-config-b", "tensor_split: [0.85, 0.15]",
                  "tensor_split: [0.8, 0.1, 0.1]")
    with pytest.raises(ConfigError) as exc:
        load_cluster(path)
    assert str(exc.value) == (f"{path}:35:5: servers.main.tensor_split: has 3 values for 2 "
                              "devices")


def test_a_worker_given_no_layers_is_named(tmp_path, headers):
    path = edited(tmp_path, "android-cpu-mesh", "tensor_split: [0.5, 0.5]",
                  "tensor_split: [1, 0]")
    _, notes = plan_placement(path, SCENARIOS["android-cpu-mesh"])
    assert notes == ["servers.main: the tensor split gives worker2:60000/CPU no layers; it is "
                     "left off llama-server's --rpc, so its loss cannot take the server down"]


def test_unknown_memory_is_said_not_guessed(headers):
    facts = dict(SCENARIOS["two-macs-config-a"])
    del facts["macmini"]
    resolved, notes = plan_placement(ROOT / "inventories/two-macs-config-a.yaml", facts)
    row = resolved.layouts[0].rows[0]
    assert (row["device"], row["free"], row["headroom"]) == ("macmini:50052/MTL0", None, None)
    assert notes == ["servers.main: free memory of macmini:50052/MTL0 is unknown: the "
                     "placement is not checked against it"]
    assert "?" in table(resolved)


def test_auto_split_follows_the_reported_memory(tmp_path, headers):
    path = edited(tmp_path, "two-cuda-11-16", "tensor_split: [11, 16]", "tensor_split: auto")
    resolved, _ = plan_placement(path, SCENARIOS["two-cuda-11-16"])
    # Free 11.5 and 16.8 GB: s0 = 11.5 / 28.3 = 0.406; il / 63 < 0.406 for il <= 25.
    assert resolved.layouts[0].rows[0]["layers"] == "0-25"


def test_an_unset_context_is_shrunk_as_llama_cpp_fits_it(headers):
    # An 8 GiB mini: config a's 9 GLM layers hold 2.9 GB of weights, but their KV at the full
    # 202752-token context (2.1 GB) leaves less than llama.cpp's 1 GiB margin. -fit shrinks an
    # unset context instead of failing; the plan shows the context it will end near.
    facts = dict(SCENARIOS["two-macs-config-a"], macmini=mac(8 * GiB, 5_726_623_061, True,
                                                             6 * GB))
    resolved, notes = plan_placement(ROOT / "inventories/two-macs-config-a.yaml", facts)
    lay = resolved.layouts[0]
    assert lay.fitted_from == 202752 and 4096 <= lay.kv.n_ctx < 202752
    assert lay.kv.n_ctx % 256 == 0
    mini = lay.rows[0]
    assert mini["headroom"] >= 2**30  # the margin llama.cpp keeps
    assert notes == [f"servers.main: ctx_size 0 asks for 202752 tokens, which do not fit; "
                     f"llama.cpp shrinks the context to fit memory (about {lay.kv.n_ctx} "
                     "tokens). Set servers.main.ctx_size to choose it"]
    assert f"KV at ~{lay.kv.n_ctx} tokens as llama.cpp fits ctx_size 0" in table(resolved)


def test_an_unset_context_cannot_save_weights_that_do_not_fit(headers):
    facts = dict(SCENARIOS["two-macs-config-a"], macmini=mac(4 * GiB, 2_863_311_530, True,
                                                             3 * GB))
    with pytest.raises(PlanError, match=r"glm does not fit at ctx_size 4096: macmini:50052/MTL0: "
                                        r"layers 0-8 need 3\.\d\d GB"):
        plan_placement(ROOT / "inventories/two-macs-config-a.yaml", facts)


def test_a_server_that_may_lose_a_worker_runs_md_failover_golden(headers):
    """The lab's server unit with the plan's placements: md-failover in llama-server's place,
    one --placement per set of workers away, and what md-failover needs of the unit."""
    from meshdeploy.roles.services.orchestrator import failover_script
    from meshdeploy.roles.services.unit_files import server_unit

    path = ROOT / "inventories" / "lab.yaml"
    planned, _ = plan_placement(path, SCENARIOS["lab"])
    cluster = load_cluster(path)
    server = cluster.server("main")
    runs = planned.runs["main"]
    assert [r.lost for r in runs] == [(), ("node2",), ("node3",)]
    text = server_unit(cluster, cluster.host("node1"), server, "/opt/meshdeploy/builds/B",
                       None, None, runs, failover_script("/opt/meshdeploy"))
    assert "SystemCallFilter=pidfd_getfd\nRuntimeDirectory=meshdeploy-server-main\n" in text
    # The script's name carries its content's digest: the golden keeps the rest of the unit.
    script = failover_script("/opt/meshdeploy")
    assert script in text
    text = text.replace(script, "/opt/meshdeploy/tools/md-failover-SHA12.py")
    golden = GOLDEN / "failover-unit-lab.txt"
    if os.environ.get("MESHDEPLOY_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text()
    # tolerate 0: llama-server itself, as before.
    plain = server_unit(cluster, cluster.host("node1"), server, "/opt/meshdeploy/builds/B",
                        None, None)
    assert "md-failover" not in plain and "--rpc 10.200.0.12:50052,10.200.0.13:50052" in plain


def test_a_worker_without_layers_is_left_off_rpc(tmp_path, headers):
    path = edited(tmp_path, "android-cpu-mesh", "tensor_split: [0.5, 0.5]",
                  "tensor_split: [1, 0]")
    planned, _ = plan_placement(path, SCENARIOS["android-cpu-mesh"])
    full = planned.runs["main"][0]
    assert full.rpc == ("worker1:60000",) and full.split == (1.0,)
