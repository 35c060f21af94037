"""GGUF headers standing in for the seed scenarios' models, which cannot be fetched here.

Each keeps the real model's architecture fields (layer count, heads, KV shape, sliding window)
and per-tensor sizes worked out from its shapes and quantisation, so placement tables show the
scenario's real split with bytes close to the real file's. They are approximations of the
files, not copies: tests built on them check meshdeploy's arithmetic, not the files.
"""

from __future__ import annotations

from meshdeploy.placement.tensors import Header

MB = 1_000_000


def _header(fields: dict, layers: list[list[tuple[str, int]]], head: list, tail: list) -> Header:
    tensors, offset = [], 10 * MB
    for name, size in head:
        tensors.append((name, offset, size))
        offset += size
    for il, layer in enumerate(layers):
        for name, size in layer:
            tensors.append((f"blk.{il}.{name}", offset, size))
            offset += size
    for name, size in tail:
        tensors.append((name, offset, size))
        offset += size
    return Header(fields, tensors, 10 * MB)


def gemma27_header() -> Header:
    """gemma-3-27b-it Q4_K_M: 62 layers, 16 KV heads of 128, tied output, window 1024. The sizes
    sum to 17.6 GB against the real file's 16.5 GB: an upper estimate."""
    layer = [("attn_norm.weight", 21504), ("attn_q.weight", 12_386_304),
             ("attn_k.weight", 6_193_152), ("attn_v.weight", 9_031_680),
             ("attn_output.weight", 12_386_304), ("ffn_gate.weight", 65_028_096),
             ("ffn_up.weight", 65_028_096), ("ffn_down.weight", 94_832_640),
             ("ffn_norm.weight", 21504)]
    fields = {"general.architecture": "gemma3", "gemma3.block_count": 62,
              "gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32,
              "gemma3.attention.head_count_kv": 16, "gemma3.attention.key_length": 128,
              "gemma3.attention.value_length": 128, "gemma3.context_length": 131072,
              "gemma3.attention.sliding_window": 1024}
    return _header(fields, [layer] * 62, [("token_embd.weight", 1_155_268_608)],
                   [("output_norm.weight", 21504)])


def glm47_flash_header() -> Header:
    """GLM-4.7-Flash Q4_K_M (about 16.9 GB; llama.cpp arch deepseek2): 47 layers, the first
    dense, then 64 routed experts (1536 wide) and a shared one; multi-head latent attention
    (kv_lora_rank 512 + 64 rope dims in the cache, no V); 154880-token vocabulary."""
    q4k = lambda params: params * 144 // 256  # Q4_K: 144 bytes per 256 weights
    q6k = lambda params: params * 210 // 256  # Q6_K: 210 bytes per 256 weights
    attn = [("attn_norm.weight", 8192), ("attn_q_a.weight", q4k(2048 * 768)),
            ("attn_q_a_norm.weight", 3072), ("attn_q_b.weight", q4k(768 * 20 * 256)),
            ("attn_kv_a_mqa.weight", q4k(2048 * 576)), ("attn_kv_a_norm.weight", 2048),
            ("attn_k_b.weight", q4k(192 * 512 * 20)), ("attn_v_b.weight", q4k(512 * 256 * 20)),
            ("attn_output.weight", q4k(20 * 256 * 2048)), ("ffn_norm.weight", 8192)]
    dense = attn + [("ffn_gate.weight", q4k(2048 * 10240)), ("ffn_up.weight", q4k(2048 * 10240)),
                    ("ffn_down.weight", q6k(10240 * 2048))]
    moe = attn + [("ffn_gate_inp.weight", 2048 * 64 * 4),
                  ("ffn_gate_exps.weight", q4k(64 * 2048 * 1536)),
                  ("ffn_up_exps.weight", q4k(64 * 2048 * 1536)),
                  ("ffn_down_exps.weight", q4k(64 * 1536 * 2048)),
                  ("ffn_gate_shexp.weight", q4k(2048 * 1536)),
                  ("ffn_up_shexp.weight", q4k(2048 * 1536)),
                  ("ffn_down_shexp.weight", q6k(1536 * 2048))]
    fields = {"general.architecture": "deepseek2", "deepseek2.block_count": 47,
              "deepseek2.context_length": 202752, "deepseek2.embedding_length": 2048,
              "deepseek2.attention.head_count": 20, "deepseek2.attention.head_count_kv": 1,
              "deepseek2.attention.key_length": 576, "deepseek2.attention.value_length": 512,
              "deepseek2.attention.key_length_mla": 256,
              "deepseek2.attention.value_length_mla": 256,
              "deepseek2.attention.kv_lora_rank": 512, "deepseek2.leading_dense_block_count": 1}
    return _header(fields, [dense] + [moe] * 46, [("token_embd.weight", q4k(154880 * 2048))],
                   [("output_norm.weight", 8192), ("output.weight", q6k(154880 * 2048))])


def synthetic_header(shape, vocab: int = 339) -> Header:
    """The header support.synthetic.write_llama writes for `shape` (F16 matrices, F32 norms,
    its 339-token vocabulary), without writing gigabytes of weights."""
    head = shape.n_embd // shape.n_head
    kv = head * shape.n_head_kv
    e, f = shape.n_embd, shape.n_ff
    layer = [("attn_norm.weight", 4 * e), ("attn_q.weight", 2 * e * e),
             ("attn_k.weight", 2 * kv * e), ("attn_v.weight", 2 * kv * e),
             ("attn_output.weight", 2 * e * e), ("ffn_norm.weight", 4 * e),
             ("ffn_gate.weight", 2 * f * e), ("ffn_up.weight", 2 * f * e),
             ("ffn_down.weight", 2 * e * f)]
    fields = {"general.architecture": "llama", "llama.block_count": shape.n_layers,
              "llama.embedding_length": e, "llama.feed_forward_length": f,
              "llama.attention.head_count": shape.n_head,
              "llama.attention.head_count_kv": shape.n_head_kv,
              "llama.context_length": shape.context}
    return _header(fields, [layer] * shape.n_layers, [("token_embd.weight", 2 * vocab * e)],
                   [("output_norm.weight", 4 * e), ("output.weight", 2 * vocab * e)])
