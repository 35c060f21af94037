"""Synthetic llama GGUF models: real llama.cpp loads and runs them, sized for what a test measures.

Weights are seeded random F16 values (the bytes are what the rpc cache and the network see;
the text they generate is meaningless but deterministic). The vocabulary is a tiny SentencePiece
one with byte fallback, enough for llama.cpp's tokenizer to encode any prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    n_layers: int = 4
    n_embd: int = 2048
    n_ff: int = 5632
    n_head: int = 16
    n_head_kv: int = 4
    context: int = 2048

    def approx_bytes(self, vocab: int) -> int:
        head = self.n_embd // self.n_head
        per_layer = (2 * self.n_embd * self.n_embd + 2 * self.n_embd * head * self.n_head_kv
                     + 3 * self.n_embd * self.n_ff) * 2 + 2 * self.n_embd * 4
        return self.n_layers * per_layer + 2 * vocab * self.n_embd * 2


# About 300 MB, three 23 MB FFN tensors per layer: fast enough for a lab test in CI.
SMALL = Shape()
# About 2.1 GB: the benchmark's model (FFN 90 MB, attention q/o 33.5 MB, k/v 8.4 MB per layer).
LARGE = Shape(n_layers=6, n_embd=4096, n_ff=11008, n_head=32, n_head_kv=8)


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,!?")
    tokens += ["\u2581" + w for w in words] + words
    types += [1] * (2 * len(words))
    scores = [0.0] * 3 + [-1000.0] * 256 + [-float(i) for i in range(2 * len(words))]
    return tokens, scores, types


def write_llama(path: Path, shape: Shape = SMALL, seed: int = 1234) -> Path:
    """Write a llama-architecture GGUF to `path` (atomically); returns the path."""
    # LabError imported only to raise it: the GPU check (benchmarks/cuda_gpu.py) writes models
    # where none of meshdeploy's own dependencies is installed (numpy and gguf are).
    try:
        from gguf import GGUFWriter
    except ImportError as exc:
        from meshdeploy.lab.errors import LabError
        raise LabError("the gguf package is missing: pip install gguf") from exc
    if shape.n_embd % shape.n_head or shape.n_head % shape.n_head_kv:
        from meshdeploy.lab.errors import LabError
        raise LabError(f"inconsistent heads in {shape}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tokens, scores, types = _vocab()
    rng = np.random.default_rng(seed)
    head = shape.n_embd // shape.n_head
    kv = head * shape.n_head_kv

    def weight(rows: int, cols: int) -> np.ndarray:
        # numpy shape (rows, cols) is ggml's ne = [cols, rows]: a cols -> rows matmul.
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    w = GGUFWriter(str(tmp), "llama")
    w.add_name("meshdeploy-synthetic")
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layers)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)  # mostly F16
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    n_vocab = len(tokens)
    w.add_tensor("token_embd.weight", weight(n_vocab, shape.n_embd))
    for il in range(shape.n_layers):
        p = f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", weight(shape.n_embd, shape.n_embd))
        w.add_tensor(p + "attn_k.weight", weight(kv, shape.n_embd))
        w.add_tensor(p + "attn_v.weight", weight(kv, shape.n_embd))
        w.add_tensor(p + "attn_output.weight", weight(shape.n_embd, shape.n_embd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", weight(shape.n_ff, shape.n_embd))
        w.add_tensor(p + "ffn_up.weight", weight(shape.n_ff, shape.n_embd))
        w.add_tensor(p + "ffn_down.weight", weight(shape.n_embd, shape.n_ff))
    w.add_tensor("output_norm.weight", np.ones(shape.n_embd, dtype=np.float32))
    w.add_tensor("output.weight", weight(n_vocab, shape.n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path
