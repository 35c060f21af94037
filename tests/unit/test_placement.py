"""placement: llama.cpp's layer split, checked on the seeds' scenarios.

Expected values are derived by hand from src/llama-model.cpp load_tensors (b11312): with -ngl
covering everything, act = n_layer + 1 (the output layer takes a slot), layer il goes to the
first device whose cumulative split point s_k satisfies s_k > il / act, computed in float32.
"""

from __future__ import annotations

import pytest

from meshdeploy.placement import layers as P
from meshdeploy.placement.tensors import Tensor

GB = 10**9


def test_exo_two_workers_half_half():
    # exo's diagram says 0-11 / 12-23; llama.cpp divides by 25: il/25 < 0.5 holds for il <= 12
    # (12/25 = 0.48, 13/25 = 0.52), so worker 1 gets 13 layers and worker 2 the rest + output.
    p = P.place(24, ["RPC0", "RPC1"], [0.5, 0.5])
    assert p.layers_of(0) == list(range(0, 13)) and p.layers_of(1) == list(range(13, 24))
    assert p.output_device == 1
    assert p.describe() == "RPC0: layers 0-12; RPC1: layers 13-23 + output"


def test_mesh_inference_config_b():
    # -ts 0.85,0.15 over [RPC0 (M4 Max via --rpc), MTL0 (the Mini's local Metal)]: RPC first.
    # GLM-4.7-Flash, 47 layers, act = 48: il/48 < 0.85 for il <= 40 (40/48 = .833, 41/48 = .854).
    p = P.place(47, ["RPC0", "MTL0"], [0.85, 0.15])
    assert len(p.layers_of(0)) == 41 and p.layers_of(1) == list(range(41, 47))
    assert p.output_device == 1


def test_split_guide_three_devices():
    devs = ["RPC0", "RPC1", "MTL0"]
    # Equal free memory: s = 1/3, 2/3, 1 over act = 48: il/48 < 1/3 for il <= 15.
    equal = P.place(47, devs, free_bytes=[20 * GB] * 3)
    assert equal.describe() == "RPC0: layers 0-15; RPC1: layers 16-31; MTL0: layers 32-46 + output"
    # The guide's log (RPC0 0-14, RPC1 15-30, MTL0 31-47 where 47 is the output) needs
    # 14/48 < s0 <= 15/48 and 30/48 < s1 <= 31/48; free 19, 21.5, 23.5 GB give s0 = .297, s1 = .633.
    guide = P.place(47, devs, free_bytes=[19 * GB, 21.5 * GB, 23.5 * GB])
    assert guide.describe() == "RPC0: layers 0-14; RPC1: layers 15-30; MTL0: layers 31-46 + output"
    # "Override proportions with --tensor-split 0.5,0.5,0": MTL0 gets nothing, not even output
    # (47/48 < 1.0 is found at RPC1, the first device whose point is 1.0).
    override = P.place(47, devs, [0.5, 0.5, 0])
    assert override.layers_of(2) == [] and override.output_device == 1
    assert override.layers_of(0) == list(range(24))


def test_float32_rounding_decides_a_boundary():
    # -ts 0.1,0.2,0.7 with 9 layers (act 10): in float32 0.1f + 0.2f == 0.3f == float(3)/10, so
    # s1 > 3/10 is false and layer 3 goes to the third device; in double 0.1 + 0.2 > 0.3 would
    # give it to the second.
    p = P.place(9, ["A", "B", "C"], [0.1, 0.2, 0.7])
    assert p.layers_of(1) == [1, 2] and p.layers_of(2)[0] == 3


def test_partial_offload_keeps_first_layers_on_cpu():
    # -ngl 10 of 18 layers: i_gpu_start = 19 - 10 = 9, act = 10; il 9..18 -> (il-9)/10 over [.5, 1].
    p = P.place(18, ["RPC0", "RPC1"], [1, 1], n_gpu_layers=10)
    assert p.layers_of(P.CPU) == list(range(9))
    assert p.layers_of(0) == list(range(9, 14)) and p.layers_of(1) == list(range(14, 18))
    assert p.output_device == 1


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="3 values for 2 devices"):
        P.place(10, ["A", "B"], [1, 1, 1])
    with pytest.raises(ValueError, match="free memory"):
        P.place(10, ["A", "B"], [0, 0])
    with pytest.raises(ValueError, match="at most 15"):
        P.place(10, ["A"] * 16, [1] * 16)


def shape(n=10, layer=1 * GB, out=2 * GB, tied=False):
    return {"n_layers": n, "layer_bytes": [layer] * n, "output_device_bytes": out,
            "tied_output": tied}


KV = [1000 * 4096] * 10  # KV bytes of each of the 10 layers


def test_fits_reports_the_numbers_of_a_refusal():
    s = shape()
    p = P.place(10, ["RPC0", "RPC1"], [1, 1])  # act 11: RPC0 il/11 < .5 -> 0..5, RPC1 6..9 + out
    fits = P.fits(p, s, KV, [8 * GB, 5 * GB], headroom=GB // 2)
    assert [f.layers for f in fits] == [6, 4]
    assert fits[0].needed == 6 * GB + 6 * 1000 * 4096 + GB // 2 and fits[0].ok
    assert fits[1].needed == 4 * GB + 2 * GB + 4 * 1000 * 4096 + GB // 2 and not fits[1].ok
    assert P.refusal(fits) == ("the model does not fit: RPC1: 4 layers need 6.52 GB (weights "
                               "6.00, KV 0.02, compute 0.50), 5.00 GB free")
    assert P.refusal(P.fits(p, s, KV, [8 * GB, 7 * GB], headroom=GB // 2)) is None


def test_auto_split_is_reproduced_by_llama_cpp():
    s = shape()
    free = [9 * GB, 3 * GB, 6 * GB]
    ts = P.auto_split(free, s, KV, headroom=GB // 2)
    # usable 8.5, 2.5, 5.5-2 (output) = 3.5 of 14.5 GB -> 10 layers cut at 5.9 and 7.6 -> 6, 2, 2.
    assert ts == [6, 2, 3]
    p = P.place(10, ["A", "B", "C"], ts)
    assert [len(p.layers_of(i)) for i in range(3)] == [6, 2, 2] and p.output_device == 2
    assert P.refusal(P.fits(p, s, KV, free, headroom=GB // 2)) is None
    # The last device cannot hold the output: it goes to the one before, the last gets nothing.
    ts = P.auto_split([9 * GB, 9 * GB, 1 * GB], s, KV, headroom=GB // 2)
    assert ts[2] == 0 and P.place(10, ["A", "B", "C"], ts).output_device == 1


def test_device_tensors_and_wire_bytes():
    MiB = 1024 * 1024
    tensors = [Tensor("token_embd.weight", 0, 50 * MiB, None),
               Tensor("blk.0.ffn_up.weight", 0, 20 * MiB, 0),
               Tensor("blk.0.attn_k.weight", 0, 4 * MiB, 0),
               Tensor("blk.1.ffn_up.weight", 0, 20 * MiB, 1),
               Tensor("output_norm.weight", 0, 1024, None)]
    p = P.place(2, ["RPC0", "RPC1"], [1, 2])  # act 3: il 0 -> RPC0; il 1, output -> RPC1
    assert [t.name for t in P.device_tensors(p, tensors, 0)] == ["blk.0.ffn_up.weight",
                                                                 "blk.0.attn_k.weight"]
    # No output.weight: the output device loads its own copy of token_embd (tied embeddings).
    on_1 = P.device_tensors(p, tensors, 1)
    assert [t.name for t in on_1] == ["token_embd.weight", "blk.1.ffn_up.weight",
                                      "output_norm.weight"]
    assert P.wire_bytes(on_1) == (70 * MiB, 1024)
    untied = tensors + [Tensor("output.weight", 0, 30 * MiB, None)]
    assert "token_embd.weight" not in [t.name for t in P.device_tensors(p, untied, 1)]
