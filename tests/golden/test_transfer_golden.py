"""The plan's "Model bytes per host" for seed scenarios with cached workers (golden).

Planned from nothing on any host: the orchestrator downloads the model once from the internet;
a worker with `cache: true` fetches only the tensors its placement holds over the LAN, or, with
`fetch: false`, copies the whole GGUF from the orchestrator over the LAN and seeds from it. A golden change
means a host would receive different bytes: update with MESHDEPLOY_UPDATE_GOLDEN=1 and review.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.device_facts import cpu, cuda
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.sources import HfFile, HfResolved
from meshdeploy.core import registry
from meshdeploy.core.context import HostContext, Steps
from meshdeploy.engine import planner as engine
from meshdeploy.roles.rpc_cache import seeding
from meshdeploy.views.plan import render_transfers

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "plan"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
FREE = 200 * 10**9
LAB_HOST = cpu(25_183_293_440, 22_800_000_000)
# name: (inventory, edits to it, device facts, model sizes)
SCENARIOS = {
    "two-cuda-11-16": ("two-cuda-11-16", (), {"box11": cuda(11_500_000_000),
                                             "box16": cuda(16_800_000_000)}),
    "two-cuda-11-16-fetch-false": ("two-cuda-11-16", (("        cache: true ",
                                                         "        fetch: false\n        cache: true "),),
                                   {"box11": cuda(11_500_000_000), "box16": cuda(16_800_000_000)}),
    "lab-cached": ("lab", (("      - port: 50052\n", "      - {port: 50052, cache: true}\n"),),
                   {"node1": LAB_HOST, "node2": LAB_HOST, "node3": LAB_HOST}),
}
SIZES = {"gemma-3-270m-q4_k_m.gguf": 253_113_024, "gemma-3-27b-it-Q4_K_M.gguf": 16_546_688_416}


def transfers(name: str, tmp_path: Path) -> list:
    inventory, edits, devices = SCENARIOS[name]
    text = (ROOT / "inventories" / f"{inventory}.yaml").read_text()
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / f"{inventory}.yaml"
    path.write_text(text)
    cluster = load_cluster(path)
    resolved = run_values(commit=COMMIT, models={
        name: HfResolved(m.source.repo, "c" * 40,
                         (HfFile(m.source.files[0], SIZES[m.source.files[0]], f"{i:064x}", "u"),))
        for i, (name, m) in enumerate(cluster.models.items())})
    facts = {h.name: {**devices[h.name], "models.DiskFree": FREE, "rpc_cache.CacheFree": FREE // 2}
             for h in cluster.hosts}
    planned = seeding.prepare(cluster, cluster.hosts, facts, resolved)
    resolved = run_values(commit=COMMIT, models=resolved.value("models", "models"),
                        seeds=planned.seeds, layouts=planned.layouts, shared=planned.shared)
    # The resources that move model bytes, evaluated as the engine does (slot-major).
    steps = Steps()
    for slot in registry.slots(cluster):
        if slot.resource.role in ("models", "rpc_cache"):
            for h in cluster.hosts:
                ctx = HostContext(cluster, h, facts[h.name], resolved, steps, cluster_facts=facts)
                steps.add(h.name, slot.name, slot.resource.plan(ctx, slot.key))
    return engine.transfer_rows([h.name for h in cluster.hosts], steps)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_model_bytes_per_host_golden(name, headers, tmp_path):
    text = render_transfers(transfers(name, tmp_path)) + "\n"
    golden = GOLDEN / f"transfers-{name}.txt"
    if os.environ.get("MESHDEPLOY_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with MESHDEPLOY_UPDATE_GOLDEN=1"
    assert text == golden.read_text()


def test_one_internet_download_and_each_worker_its_share(headers, tmp_path):
    # gemma-3-270m: only token_embd (178 MB, the tied output on the last device) is over the
    # rpc cache's 10 MiB threshold. node3 holds the output; node2 holds it in the placement
    # without node3 (servers.main.failover.seed), so both fetch it, over the LAN.
    size = SIZES["gemma-3-270m-q4_k_m.gguf"]
    rows = {r.host: r for r in transfers("lab-cached", tmp_path)}
    assert sum(r.internet_bytes for r in rows.values()) == size == rows["node1"].internet_bytes
    assert rows["node3"].internet_bytes == 0 and 0 < rows["node3"].lan_bytes < size
    assert rows["node2"].internet_bytes == 0 and rows["node2"].lan_bytes == rows["node3"].lan_bytes
    big = SIZES["gemma-3-27b-it-Q4_K_M.gguf"]
    rows = {r.host: r for r in transfers("two-cuda-11-16", tmp_path)}
    assert rows["box16"].internet_bytes == big and rows["box11"].internet_bytes == 0
    assert rows["box11"].lan_bytes == rows["box11"].disk_bytes < big / 2
    assert rows["box11"].disk_free == FREE // 2
    # fetch: false keeps a whole GGUF on the worker: copied over the LAN, still no second
    # internet download.
    whole = {r.host: r for r in transfers("two-cuda-11-16-fetch-false", tmp_path)}
    assert whole["box11"].internet_bytes == 0 and whole["box11"].lan_bytes == big
    assert whole["box11"].disk_bytes == big + rows["box11"].disk_bytes
