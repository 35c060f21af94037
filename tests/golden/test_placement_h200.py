"""The plan's placement against what llama.cpp allocated on a real GPU.

benchmarks/cuda_gpu.py ran the cluster below on an NVIDIA H200 (2026-11-29, docs/gpu.md): the
CUDA worker's `ggml-rpc-server -d CUDA0` and a CPU orchestrator's `llama-server --rpc -ngl 99
-c 4096` on a synthetic llama of 12 layers (F16, n_embd 4096, 4.26 GB). llama.cpp logged, for
RPC0 (the worker's CUDA0): model buffer 4059.04 MiB, KV buffer 192.00 MiB, compute buffer
92.51 MiB. The DeviceMemory fact is the probe's real output there (tests/fixture/facts/
rpc_cache.DeviceMemory/h200_real.json). A change here means meshdeploy counts a GPU's memory
differently from llama.cpp.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from support.model_headers import synthetic_header
from support.synthetic import Shape, _vocab

from meshdeploy.core.loading import load_cluster
from meshdeploy.placement import layout
from meshdeploy.placement.tensors import model_shape, weight_tensors
from meshdeploy.roles.rpc_cache.facts import DeviceMemory

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import cuda_gpu  # noqa: E402

FACT = ROOT / "tests" / "fixture" / "facts" / "rpc_cache.DeviceMemory" / "h200_real.json"
MiB = 1 << 20
# llama.cpp's own lines on the H200 (server-ngl99.log), in MiB to two places as it prints them.
LLAMA_CPP = {"model": 4059.04, "KV": 192.00, "compute": 92.51, "cpu_mapped": 2.65}


def test_the_plans_weights_and_kv_are_what_llama_cpp_allocated_on_the_h200(tmp_path):
    assert len(_vocab()[0]) == 339  # the header below is the writer's, vocabulary included
    path = tmp_path / "cluster.yaml"
    path.write_text(cuda_gpu.cluster_text("90", "cuda"))
    cluster = load_cluster(path)
    server = next(s for s in cluster.servers if s.name == "main")
    header = synthetic_header(cuda_gpu.SHAPE)
    assert cuda_gpu.SHAPE == Shape(n_layers=12, n_embd=4096, n_ff=11008, n_head=32,
                                   n_head_kv=8, context=4096)
    memory = DeviceMemory().process(json.loads(FACT.read_text())["output"])
    lay = layout.build(cluster, server, weight_tensors(header), model_shape(header),
                       {"gpu": memory})
    [row] = lay.rows
    assert row["device"] == "gpu:50052/CUDA0" and row["layers"] == "0-11 + output"
    assert round(row["weights"] / MiB, 2) == LLAMA_CPP["model"]
    assert round(row["kv"] / MiB, 2) == LLAMA_CPP["KV"]
    # The free column: nvidia-smi's free before the worker started (143156 MiB) less a CUDA
    # context, against the worker's own Devices: line once its context was up (142629 MiB).
    assert abs(row["free"] - 142629 * MiB) <= 16 * MiB
    # llama.cpp's compute buffer fits in the plan's headroom.
    assert row["needed"] - row["weights"] - row["kv"] >= LLAMA_CPP["compute"] * MiB
    # token_embd stays in the orchestrator's memory (CPU_Mapped): not on the worker's row.
    embd = next(t.size for t in weight_tensors(header) if t.name == "token_embd.weight")
    assert round(embd / MiB, 2) == LLAMA_CPP["cpu_mapped"]
