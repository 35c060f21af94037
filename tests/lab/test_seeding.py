"""Zero weight transfer on the lab: pre-seeded rpc-server caches versus the stock load.

A synthetic llama GGUF (~360 MB, three 23 MB FFN tensors per layer) is served by the lab's HF
mirror and loaded through node2 and node3. The bytes the bridge sends to each worker while
llama-server restarts are counted on the worker's veth: stock, every weight crosses; seeded,
only the tensors of 10 MiB or less (and protocol chatter) do. Greedy output must not change.
Runs after test_cluster.py and puts the gemma cluster back when done.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from meshdeploy.lab import base, hfmirror, wire
from meshdeploy.lab.synthetic import SMALL, write_llama
from meshdeploy.roles.rpc_cache.placement import device_tensors, place, wire_bytes
from meshdeploy.roles.rpc_cache.tensors import weight_tensors

pytestmark = [pytest.mark.lab, pytest.mark.build]

REPO = Path(__file__).resolve().parents[2]
SLACK = 4 * 1024 * 1024  # RPC commands, graph uploads, TCP/IP headers: far below one tensor


def meshdeploy(*args):
    proc = subprocess.run([sys.executable, "-m", "meshdeploy", *map(str, args)],
                          capture_output=True, text=True, timeout=3600, stdin=subprocess.DEVNULL)
    print(f"$ meshdeploy {' '.join(map(str, args))} -> {proc.returncode}\n{proc.stdout[-4000:]}")
    print(proc.stderr[-3000:], file=sys.stderr)
    return proc


def _restore(lab, tmp_path):
    gemma = tmp_path / "restore" / "lab.yaml"
    gemma.parent.mkdir()
    text = (REPO / "inventories" / "lab.yaml").read_text()
    text = text.replace("http://127.0.0.1:18080", lab.mirrors["hf_api_endpoint"])
    gemma.write_text(text.replace("/var/lib/meshdeploy/lab/mdlab/ssh_config", lab.ssh["config"]))
    assert meshdeploy("apply", gemma, "--auto-approve").returncode == 0
    for host in ("node2", "node3"):
        lab.run(host, "sudo rm -rf /opt/meshdeploy/models/synthetic "
                      "/var/cache/meshdeploy-rpc-50052/rpc")


def test_seeded_load_sends_no_cached_weight(lab, tmp_path):
    model = write_llama(tmp_path / "synthetic.gguf", SMALL)
    served = hfmirror.add_file(base.cache_root() / "hf", "meshdeploy/synthetic-llama",
                               "synthetic.gguf", model)
    tensors = weight_tensors(model)
    placement = place(SMALL.n_layers, ["node2", "node3"], [1, 1])
    per_worker = {h: device_tensors(placement, tensors, i) for i, h in enumerate(["node2", "node3"])}
    results = {}
    try:
        for cache in (False, True):
            folder = tmp_path / ("seeded" if cache else "stock")
            folder.mkdir()
            cluster = folder / "synthetic.yaml"
            cluster.write_text(wire.cluster_yaml(lab, served["repo"], served["file"],
                                                 served["sha256"], cache))
            applied = meshdeploy("apply", cluster, "--auto-approve")
            assert applied.returncode == 0, applied.stderr
            if cache:
                assert "Placement of synthetic for llama-server main" in applied.stdout
            before = {h: wire.tx_bytes(lab.name, h) for h in per_worker}
            seconds = wire.restart_server(lab)
            sent = {h: wire.tx_bytes(lab.name, h) - before[h] for h in per_worker}
            results[cache] = {"sent": sent, "seconds": seconds, "text": wire.complete(lab)}
            print(f"cache={cache}: {seconds:.2f} s to /health 200, sent {sent}")
            again = meshdeploy("plan", cluster, "--detailed-exitcode")
            assert again.returncode == 0, again.stdout
    finally:
        _restore(lab, tmp_path)
    for host, mine in per_worker.items():
        hashed, small = wire_bytes(mine)
        assert hashed > 2 * 10 * 1024 * 1024, f"{host} gets too few large tensors to tell"
        assert results[False]["sent"][host] >= hashed + small  # stock: every weight crosses
        # Seeded: not one byte of a cached tensor (each > 10 MiB) crossed, only the small ones.
        assert results[True]["sent"][host] <= small + SLACK, (host, results[True]["sent"], small)
    assert results[True]["text"] == results[False]["text"]
    assert results[True]["text"].strip()
