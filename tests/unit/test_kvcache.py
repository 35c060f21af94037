"""kvcache: llama-server's KV cache per layer, sized by llama.cpp's own rules (b11312).

Expected cell counts are worked out by hand from src/llama-kv-cache-iswa.cpp and
src/llama-context.cpp, as the comments show.
"""

from __future__ import annotations

import pytest

from meshdeploy.placement import kvcache as K


def gemma3_270m_shape():
    # gemma-3-270m: 18 layers, 1 KV head of 256, a 512-token window (its GGUF's values).
    fields = {"gemma3.attention.sliding_window": 512}
    swa, n_swa = K.swa_layers(fields, "gemma3", 18)
    return {"n_layers": 18, "k_elems_layer": [256] * 18, "v_elems_layer": [256] * 18,
            "swa_layers": swa, "n_swa": n_swa}


def test_gemma3_sliding_layers_hold_a_window_not_the_context():
    s = gemma3_270m_shape()
    assert [il for il, swa in enumerate(s["swa_layers"]) if not swa] == [5, 11, 17]
    kv = K.layer_bytes(s, K.settings(0, 32768))
    # Full layers: 32768 cells x (256 + 256) f16 = 32 MiB. Sliding: 4 slots (llama-server's
    # auto -np with a unified cache) x 512 + ubatch 512 = 2560 cells (already a multiple of 256).
    assert kv[5] == 32768 * 512 * 2 == 33_554_432
    assert kv[0] == 2560 * 512 * 2 == 2_621_440
    assert sum(kv) == 3 * 33_554_432 + 15 * 2_621_440
    # --swa-full gives every layer the whole context: the old, pessimistic count.
    full = K.layer_bytes(s, K.settings(0, 32768, ["--swa-full"]))
    assert full == [33_554_432] * 18


def test_explicit_slots_split_the_context_into_streams():
    s = gemma3_270m_shape()
    st = K.settings(8192, 32768, ["-np", "2"])
    assert (st.n_seq, st.unified, st.n_ctx) == (2, False, 8192)
    kv = K.layer_bytes(s, st)
    # Not unified: 2 streams of n_ctx_seq = 4096 cells; sliding: min(4096, 512 + 512) = 1024.
    assert kv[5] == 2 * 4096 * 1024 and kv[0] == 2 * 1024 * 1024
    assert K.settings(8192, 0, ["--parallel=2", "-kvu"]).unified


def test_context_is_padded_and_cache_types_shrink_cells():
    s = {"n_layers": 2, "k_elems_layer": [1024, 1024], "v_elems_layer": [1024, 1024],
         "swa_layers": [False, False], "n_swa": 0}
    # 1000 -> 1024 cells; q8_0 stores 32 elements in 34 bytes.
    st = K.settings(1000, 4096, ["-ctk", "q8_0", "--cache-type-v=q8_0"])
    assert K.layer_bytes(s, st) == [1024 * 2 * (1024 * 34 // 32)] * 2
    with pytest.raises(ValueError, match="unknown KV cache type 'q9_9'"):
        K.layer_bytes(s, K.settings(1000, 4096, ["-ctk", "q9_9"]))


def test_patterns_follow_the_architecture_and_the_gguf():
    # gemma2 slides every other layer with a 4096 default window, even without the key.
    swa, n = K.swa_layers({}, "gemma2", 4)
    assert swa == [True, False, True, False] and n == 4096
    # dense_first architectures keep layer 0 (and each pattern start) full.
    swa, _ = K.swa_layers({"laguna.attention.sliding_window": 128}, "laguna", 5)
    assert swa == [False, True, True, True, False]
    # The GGUF's own pattern wins: a scalar period, or one flag per layer.
    swa, _ = K.swa_layers({"gemma3.attention.sliding_window": 1024,
                           "gemma3.attention.sliding_window_pattern": 2}, "gemma3", 4)
    assert swa == [True, False, True, False]
    swa, _ = K.swa_layers({"gemma3.attention.sliding_window": 1024,
                           "gemma3.attention.sliding_window_pattern": [0, 1, 1]}, "gemma3", 4)
    assert swa == [False, True, True, False]
    # gemma3 without a window, and an architecture not listed: full context everywhere.
    assert K.swa_layers({}, "gemma3", 3) == ([False] * 3, 0)
    assert K.swa_layers({"llama.attention.sliding_window": 4096}, "llama", 3) == ([False] * 3, 0)


def test_settings_ignore_what_they_cannot_read():
    st = K.settings(0, 4096, ["-np", "many", "-ub"])
    assert st == K.KvSettings(n_ctx=4096)
    assert K.settings(0, 4096, ["-np", "-1"]).unified  # -1 is llama-server's auto


def test_unset_context_and_what_fit_keeps():
    # Not unified: the training context per stream (common/fit.cpp), here 2 x 32768.
    assert K.settings(0, 32768, ["-np", "2"]).n_ctx == 65536
    s = K.settings(0, 32768)
    # The largest multiple of 256 that passes, never below the 4096-token floor.
    assert K.fitted_ctx(s, 32768, lambda n: n <= 10_000) == 9984
    assert K.fitted_ctx(s, 32768, lambda n: True) == 32768
    assert K.fitted_ctx(s, 32768, lambda n: n < 4096) is None
    assert K.fitted_ctx(s, 2048, lambda n: True) == 32768  # a 2K model's floor is its context
