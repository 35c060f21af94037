"""The plan's KV cache figures against llama.cpp's own, on the lab's real build and model.

llama-server logs each KV cache it allocates at verbosity 4 (-lv 4):
    llama_kv_cache: size =   32.00 MiB (  2048 cells,   3 layers,  4/4 seqs), K (f16): ...
one line for the full-context layers and one for the sliding-window layers. kvcache.layer_bytes
must give the same cells, layers and bytes for every setting tried here.
"""

from __future__ import annotations

import base64
import re

import pytest
from support.cli import meshdeploy
from support.labfile import write_lab_file

from meshdeploy.placement import kvcache
from meshdeploy.placement.tensors import model_shape

pytestmark = [pytest.mark.lab, pytest.mark.build]

BINARY = "/opt/meshdeploy/current/bin/llama-server"
MODEL = "/opt/meshdeploy/models/gemma/gemma-3-270m-q4_k_m.gguf"
LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers")


@pytest.fixture(scope="module")
def built(lab, tmp_path_factory):
    """node1 with the gemma cluster applied (test_cluster.py leaves it so; else apply it)."""
    if lab.run("node1", f"test -x {BINARY} && test -r {MODEL}").returncode != 0:
        path = write_lab_file(lab, tmp_path_factory.mktemp("kv"))
        assert meshdeploy("apply", path, "--auto-approve").returncode == 0
    return lab


def logged_kv(lab, args: list[str]) -> list[tuple[int, int, float]]:
    """(cells, layers, MiB) of each KV cache llama-server allocates with `args` (CPU only)."""
    script = (f"cd /tmp; {BINARY} -m {MODEL} --host 127.0.0.1 --port 8099 "
              f"-ngl 0 -lv 4 {' '.join(args)} > /tmp/kv.log 2>&1 & p=$!; "
              "for i in $(seq 600); do grep -q 'listening on' /tmp/kv.log && break; "
              "kill -0 $p 2>/dev/null || break; sleep 0.1; done; kill -9 $p; wait $p; "
              "grep 'llama_kv_cache: size' /tmp/kv.log; rm -f /tmp/kv.log")
    out = lab.run("node1", script, timeout=180).stdout
    return [(int(c), int(n), float(mib)) for mib, c, n in LINE.findall(out)]


@pytest.mark.parametrize("args", [
    ["-c", "2048"],
    ["-c", "0"],
    ["-c", "8192", "-np", "2"],
    ["-c", "3000", "--swa-full"],
    ["-c", "4096", "-ub", "256", "-ctk", "q8_0"],
], ids=lambda a: " ".join(a))
def test_kv_cache_matches_llama_cpp(built, args, tmp_path):
    logged = logged_kv(built, args)
    assert logged, "llama-server logged no KV cache size"
    got = built.run("node1", f"head -c 8388608 {MODEL} | base64 -w0", timeout=60).stdout
    header = tmp_path / "gemma-head.gguf"
    header.write_bytes(base64.b64decode(got))
    shape = model_shape(str(header))
    ctx = int(args[args.index("-c") + 1])
    settings = kvcache.settings(ctx, shape["n_ctx_train"], args)
    per_layer = kvcache.layer_bytes(shape, settings)
    predicted = []
    for swa in (False, True):
        layers = [il for il in range(shape["n_layers"]) if shape["swa_layers"][il] == swa]
        if layers:
            total = sum(per_layer[il] for il in layers)
            # The log counts cells per stream (-np without a unified cache: one per slot).
            streams = 1 if settings.unified else settings.n_seq
            cells = total // streams // sum(kvcache.type_bytes(settings.type_k, shape["k_elems_layer"][il])
                                 + kvcache.type_bytes(settings.type_v, shape["v_elems_layer"][il])
                                 for il in layers)
            predicted.append((cells, len(layers), round(total / 2**20, 2)))
    print(f"{' '.join(args)}: llama.cpp {logged}, meshdeploy {predicted}")
    assert sorted(logged) == sorted(predicted)
