"""placement: auto on real hosts whose workers differ in speed: the shared converged lab
(node1 orchestrates over node2 and node3), both rpc-servers on one thread, node3's sharing its
core with three busy loops (support.contention: two threads on node2 only crowded the machine's
two cores and made node2 the slower one; with one loop, other work on the machine made the two
look alike), serving a synthetic llama (12 layers of 23 MB, a small
output: the layers are what the devices read; gemma's 178 MB output matrix would stay on one
device in every split).

bench --sweep measures the devices; the plan then predicts tokens/s, and with placement: auto
gives node2, the faster worker, more layers than the split by memory (even: the two hosts
report the same free memory), writes that split as -ts, and the next plan says "No changes".
Tokens/s themselves belong to benchmarks/placement.py, never to an assertion here. The module
puts the cluster back as it found it.
"""

from __future__ import annotations

import json

import pytest
from support import contention, wire
from support.cli import meshdeploy
from support.synthetic import Shape, write_llama
from test_cluster import variant

from meshdeploy.lab import base, hfstore

pytestmark = [pytest.mark.lab, pytest.mark.build, pytest.mark.quiet]

MODEL = Shape(n_layers=12, n_embd=1024, n_ff=2816, n_head=16, n_head_kv=4)
WORKER = "      - {port: 50052, cache: false}\n"
RPC = ("node2:50052/CPU", "node3:50052/CPU")


def threads(text: str, fast: int, slow: int) -> str:
    """`text` with node2's rpc-server on `fast` threads and node3's on `slow`."""
    first, second, rest = text.split(WORKER, 2)
    assert "  node2:" in first and "  node3:" not in first and "  node3:" in second
    one = "      - {port: 50052, cache: false, threads: %d}\n"
    return first + one % fast + second + one % slow + rest


def placed(path) -> dict:
    proc = meshdeploy("plan", path, "--json")
    assert proc.returncode == 0, proc.stderr
    (p,) = json.loads(proc.stdout)["placement"]
    layers = {r["device"]: (0 if r["first_layer"] is None
                            else r["last_layer"] - r["first_layer"] + 1) for r in p["rows"]}
    return {"split_by": p["split_by"], "speed": p["speed"], "layers": layers}


def test_auto_gives_the_faster_worker_more_layers(converged_lab, tmp_path):
    info, _, cluster_file = converged_lab
    model = write_llama(tmp_path / "layers.gguf", MODEL)
    served = hfstore.add_file(base.cache_root() / "hf", "meshdeploy/synthetic-layers",
                               "layers.gguf", model)
    text = wire.cluster_yaml(info, served["repo"], served["file"], served["sha256"], False,
                             tensor_split="auto", ctx=4096)
    default_text = threads(text, 1, 1)
    memory_text = default_text.replace("    model: synthetic\n",
                                       "    model: synthetic\n    placement: memory\n", 1)
    hetero = variant(cluster_file, "hetero.yaml", cluster_file.read_text(), memory_text)
    try:
        applied = meshdeploy("apply", hetero, "--auto-approve")
        assert applied.returncode == 0, applied.stderr
        for host in ("node2", "node3"):
            unit = info.run(host, "systemctl show -p ExecStart --value meshdeploy-rpc-50052")
            assert " -t 1 " in unit.stdout, unit.stdout
        contention.slow_down(info, "node2", "node3", loops=3)
        # --no-local: the orchestrator alone is test_bench_lab's (here node1's two threads
        # would share a core with the busy loop, at a few tokens/s).
        swept = meshdeploy("bench", hetero, "--sweep", "--points", "4", "--runs", "1",
                           "--no-local", "--auto-approve")
        assert swept.returncode == 0, swept.stderr
        print(swept.stdout)
        assert hetero.with_name("hetero.speed.json").is_file()

        memory = placed(hetero)
        assert memory["split_by"] == "memory" and memory["speed"] is not None
        even = memory["layers"]
        assert abs(even[RPC[0]] - even[RPC[1]]) <= 2, even  # 13 slots: the output takes one

        hetero.write_text(memory_text.replace("placement: memory", "placement: auto", 1))
        auto = placed(hetero)
        hetero.write_text(default_text)  # placement unset: auto is the default
        assert placed(hetero) == auto
        print(f"split by memory {even}: predicted {memory['speed']['gen_tps']} tok/s; "
              f"placement auto {auto['layers']}: predicted {auto['speed']['gen_tps']} tok/s")
        assert auto["split_by"] == "speed", auto
        assert auto["layers"][RPC[0]] > even[RPC[0]], (auto, even)
        assert auto["speed"]["gen_tps"] > auto["speed"]["memory_gen_tps"]

        applied = meshdeploy("apply", hetero, "--auto-approve")
        assert applied.returncode == 0, applied.stderr
        # llama-server runs under md-failover (the unit's main process): its own argv.
        argv = info.run("node1", "cat /proc/$(pgrep -x llama-server | head -n 1)/cmdline",
                        root=True).stdout.split("\0")
        assert "-ts" in argv, argv
        again = meshdeploy("plan", hetero, "--detailed-exitcode")
        assert again.returncode == 0, again.stdout
    finally:
        contention.release(info, "node3")
        restored = meshdeploy("apply", cluster_file, "--auto-approve")
        assert restored.returncode == 0, restored.stderr
        info.run("node1", "sudo rm -rf /opt/meshdeploy/models/synthetic")
