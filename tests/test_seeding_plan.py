"""rpc_cache wiring: which worker seeds which tensors, and the plan's placement table (golden).

The model behind inventories/two-cuda-11-16.yaml (gemma-3-27b Q4_K_M) cannot be fetched here;
a header with its layer count and per-tensor sizes stands in for it, so the table shows the
seed scenario's real split (11 GB card over RPC, 16 GB card local) with realistic bytes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshdeploy.deploy.config import load_cluster
from meshdeploy.deploy.context import Resolved
from meshdeploy.deploy.errors import PlanError
from meshdeploy.roles.models import operations as models
from meshdeploy.roles.models.hf import HfFile, HfResolved
from meshdeploy.roles.rpc_cache import seeding
from meshdeploy.roles.rpc_cache.tensors import Header

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden_plan"
SHA = "ab" * 32
MB = 1_000_000


def gemma27_header() -> Header:
    sizes = [("attn_norm.weight", 21504), ("attn_q.weight", 12_386_304),
             ("attn_k.weight", 6_193_152), ("attn_v.weight", 9_031_680),
             ("attn_output.weight", 12_386_304), ("ffn_gate.weight", 65_028_096),
             ("ffn_up.weight", 65_028_096), ("ffn_down.weight", 94_832_640),
             ("ffn_norm.weight", 21504)]
    tensors, offset = [], 10 * MB
    tensors.append(("token_embd.weight", offset, 1_155_268_608))
    offset += 1_155_268_608
    for il in range(62):
        for name, size in sizes:
            tensors.append((f"blk.{il}.{name}", offset, size))
            offset += size
    tensors.append(("output_norm.weight", offset, 21504))
    fields = {"general.architecture": "gemma3", "gemma3.block_count": 62,
              "gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32,
              "gemma3.attention.head_count_kv": 16, "gemma3.attention.key_length": 128,
              "gemma3.attention.value_length": 128, "gemma3.context_length": 131072}
    return Header(fields, tensors, 10 * MB)


def prepared(path: str, facts: dict, header: Header):
    cluster = load_cluster(ROOT / path)
    resolved = Resolved(models={
        "gemma27": HfResolved("unsloth/gemma-3-27b-it-GGUF", "c" * 40,
                              (HfFile("gemma-3-27b-it-Q4_K_M.gguf", 16_546_688_000, SHA, "u"),))})
    fetched = []

    def fetch(url, size, token=None):
        fetched.append(url)
        p = Path(os.environ.get("PYTEST_TMP", "/tmp")) / f"hdr-{os.getpid()}"
        p.write_bytes(b"")
        return p

    import meshdeploy.roles.rpc_cache.seeding as mod
    original = mod.read_header
    mod.read_header = lambda _path: header
    try:
        seeding.prepare(cluster, cluster.hosts, facts, resolved, fetch=fetch)
    finally:
        mod.read_header = original
    return cluster, resolved, fetched


GPU_FACTS = {"box11": {"rpc_cache.DeviceMemory": {"cpu": None, "cuda": [
                 {"total": 11811160064, "free": 11500000000}]}},
             "box16": {"rpc_cache.DeviceMemory": {"cpu": None, "cuda": [
                 {"total": 17179869184, "free": 16800000000}]}}}


def test_two_cuda_placement_table_golden():
    _, resolved, fetched = prepared("inventories/two-cuda-11-16.yaml", GPU_FACTS, gemma27_header())
    # The control machine's endpoint, pinned to the resolved commit, never the hosts' one.
    assert fetched == ["https://huggingface.co/unsloth/gemma-3-27b-it-GGUF/resolve/"
                       + "c" * 40 + "/gemma-3-27b-it-Q4_K_M.gguf"]
    text = seeding.table(resolved.layouts) + "\n"
    golden = GOLDEN / "placement-two-cuda-11-16.txt"
    if os.environ.get("MESHDEPLOY_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with MESHDEPLOY_UPDATE_GOLDEN=1"
    assert text == golden.read_text()


def test_only_the_cached_worker_seeds_its_own_layers():
    cluster, resolved, _ = prepared("inventories/two-cuda-11-16.yaml", GPU_FACTS, gemma27_header())
    assert list(resolved.seeds) == ["box11:50052"]
    (seed,) = resolved.seeds["box11:50052"]
    assert seed.model_sha == SHA
    assert seed.model_path == "/opt/meshdeploy/models/gemma27/gemma-3-27b-it-Q4_K_M.gguf"
    rpc_row = resolved.layouts[0].rows[0]
    # -ts 11,16 over 62 layers + output: llama.cpp gives the RPC card layers 0..25.
    assert rpc_row["layers"] == "0-25"
    assert {t.layer for t in seed.tensors} == set(range(26))
    assert sum(t.size for t in seed.tensors if t.hashed) == rpc_row["seed"] > 0
    # The worker must hold the GGUF to seed from it; the orchestrator loads it anyway.
    assert models.needed(cluster, cluster.host("box11")) == ["gemma27"]


def test_auto_split_without_memory_facts_is_refused(tmp_path):
    text = (ROOT / "inventories/two-cuda-11-16.yaml").read_text()
    path = tmp_path / "auto.yaml"
    path.write_text(text.replace("tensor_split: [11, 16]", "tensor_split: auto"))
    cluster = load_cluster(path)
    resolved = Resolved(models={"gemma27": HfResolved("r", "c" * 40, (HfFile("f", 1, SHA, "u"),))})
    import meshdeploy.roles.rpc_cache.seeding as mod
    original = mod.read_header
    mod.read_header = lambda _path: gemma27_header()
    try:
        with pytest.raises(PlanError, match="free memory of box11:50052/CUDA0, box16/CUDA0"):
            seeding.prepare(cluster, cluster.hosts, {}, resolved,
                            fetch=lambda *a, **k: tmp_path.joinpath("h").touch() or
                            tmp_path / "h")
    finally:
        mod.read_header = original


def test_header_cache_spares_the_next_plan_a_fetch(tmp_path):
    cluster = load_cluster(ROOT / "inventories/two-cuda-11-16.yaml")
    fetched = []

    def fetch(url, size, token=None, dest=None):
        fetched.append(url)
        dest.write_bytes(b"")
        return dest

    import meshdeploy.roles.rpc_cache.seeding as mod
    original = mod.read_header
    mod.read_header = lambda _path: gemma27_header()
    try:
        for _ in range(2):
            resolved = Resolved(models={"gemma27": HfResolved(
                "unsloth/gemma-3-27b-it-GGUF", "c" * 40,
                (HfFile("gemma-3-27b-it-Q4_K_M.gguf", 16_546_688_000, SHA, "u"),))})
            seeding.prepare(cluster, cluster.hosts, GPU_FACTS, resolved,
                            fetch=fetch, header_cache=tmp_path)
            assert resolved.layouts
    finally:
        mod.read_header = original
    assert len(fetched) == 1
    assert [p.name for p in tmp_path.iterdir()] == [f"{SHA}.gguf"]
