"""How many bytes of KV cache llama-server allocates per layer, as llama.cpp sizes it (b11312).

The KV cache of layer il lives on the device that holds layer il (offload_kqv is on by default),
so a placement's memory check needs it per layer. From src/llama-context.cpp,
src/llama-kv-cache.cpp and src/llama-kv-cache-iswa.cpp:

    n_ctx        = GGML_PAD(ctx_size or n_ctx_train, 256)
    n_seq_max    = --parallel (llama-server's auto: 4 slots with a unified cache)
    full layer   : n_ctx cells
    sliding layer: GGML_PAD(min(n_ctx_seq, n_swa * (unified ? n_seq_max : 1) + n_ubatch), 256)
                   cells per stream (n_ctx cells with --swa-full)
    cell bytes   : n_embd_k_gqa elements of type_k + n_embd_v_gqa elements of type_v; models with
                   multi-head latent attention (MLA) keep no V cache

Which layers slide is per architecture (src/models/<arch>.cpp: load_swa_pattern(ml, n, dense_first)),
overridden by the GGUF's <arch>.attention.sliding_window_pattern. Architectures not listed here
are counted at full context in every layer: an upper bound, never an underestimate. Recurrent
state (Mamba, RWKV, hybrid layers) is not modelled: their layers are counted as attention layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshdeploy.core.gguf import GGML_QUANT_SIZES, GGMLQuantizationType

PAD = 256  # llama-context pads n_ctx, and the SWA cache, to 256 cells

# arch -> (pattern, dense_first, n_swa default when the GGUF has none). Sliding window applies
# only when the GGUF's <arch>.attention.sliding_window is positive, or a default is given here.
SWA_PATTERNS: dict[str, tuple[int, bool, int]] = {
    "gemma2": (2, False, 4096),
    "gemma3": (6, False, 0),
    "gemma3n": (5, False, 0),
    "gemma-embedding": (6, False, 0),
    "cohere2": (4, False, 0),
    "cohere2moe": (4, True, 0),
    "gpt-oss": (2, False, 0),
    "olmo2": (4, False, 0),
    "llama4": (4, False, 0),  # chunked attention: 3 chunked layers, then 1 full
    "afmoe": (4, False, 0),
    "exaone-moe": (4, False, 0),
    "mellum": (4, False, 0),
    "muse-glimmer": (4, False, 0),
    "plamo3": (8, False, 0),
    "laguna": (4, True, 0),
}


def swa_layers(fields: dict, arch: str, n_layers: int) -> tuple[list[bool], int]:
    """(is layer il sliding-window, window size) from the GGUF fields; all False when unknown."""
    none = [False] * n_layers
    if arch not in SWA_PATTERNS:
        return none, 0
    pattern, dense_first, default_swa = SWA_PATTERNS[arch]
    n_swa = int(fields.get(f"{arch}.attention.sliding_window") or default_swa)
    if n_swa <= 0:
        return none, 0
    given = fields.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(given, list):
        flags = [bool(v) for v in given][:n_layers]
        return flags + [False] * (n_layers - len(flags)), n_swa
    if isinstance(given, int) and not isinstance(given, bool):
        pattern = int(given)
    # llama_hparams::set_swa_pattern
    if dense_first:
        return [pattern == 0 or il % pattern != 0 for il in range(n_layers)], n_swa
    return [pattern == 0 or il % pattern < pattern - 1 for il in range(n_layers)], n_swa


@dataclass(frozen=True)
class KvSettings:
    """llama-server's options that size its KV cache (defaults: llama-server's own)."""

    n_ctx: int
    n_seq: int = 4
    unified: bool = True
    n_ubatch: int = 512
    swa_full: bool = False
    type_k: str = "f16"
    type_v: str = "f16"


_VALUE_FLAGS = {"-np": "n_seq", "--parallel": "n_seq", "-ub": "n_ubatch",
                "--ubatch-size": "n_ubatch", "-ctk": "type_k", "--cache-type-k": "type_k",
                "-ctv": "type_v", "--cache-type-v": "type_v"}


def settings(ctx_size: int, n_ctx_train: int, extra_args=()) -> KvSettings:
    """The KV settings of a llama-server from its ctx_size and extra_args.

    Example: settings(32768, 131072, ["-np", "1"]) == KvSettings(32768, n_seq=1, unified=False)
    """
    values: dict = {}
    explicit_np = False
    unified = None
    args = list(extra_args)
    for i, arg in enumerate(args):
        name, eq, inline = arg.partition("=")
        key = _VALUE_FLAGS.get(name)
        if key is not None:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
            if value is None:
                continue
            if key in ("n_seq", "n_ubatch"):
                try:
                    values[key] = int(value)
                except ValueError:
                    continue
                explicit_np |= key == "n_seq"
            else:
                values[key] = value.lower()
        elif arg == "--swa-full":
            values["swa_full"] = True
        elif arg in ("-kvu", "--kv-unified"):
            unified = True
        elif arg in ("-no-kvu", "--no-kv-unified"):
            unified = False
    n_seq = values.pop("n_seq", 4)
    if n_seq < 0:  # -np -1: llama-server's auto
        n_seq, explicit_np = 4, False
    if unified is None:
        # server.cpp: only the automatic slot count turns on the unified cache.
        unified = not explicit_np
    n_seq = max(n_seq, 1)
    # common/fit.cpp: an unset context is the training context per stream (one stream when
    # the cache is unified); llama.cpp may then shrink it to fit memory (see fitted_ctx).
    n_ctx = ctx_size if ctx_size > 0 else n_ctx_train * (1 if unified else n_seq)
    return KvSettings(n_ctx=n_ctx, n_seq=n_seq, unified=unified, **values)


# common/fit.cpp (-fit, on by default): with ctx_size 0, a context that does not fit is shrunk
# until every device keeps this margin free, but not below FIT_MIN_CTX tokens per stream.
FIT_MARGIN = 1024 * 1024 * 1024
FIT_MIN_CTX = 4096


def fit_floor(s: KvSettings, n_ctx_train: int) -> int:
    """The smallest context -fit shrinks to."""
    streams = 1 if s.unified else s.n_seq
    return _pad(min(FIT_MIN_CTX, n_ctx_train or FIT_MIN_CTX) * streams)


def fitted_ctx(s: KvSettings, n_ctx_train: int, fits_at) -> int | None:
    """The largest context (a multiple of 256) at which fits_at(n_ctx) holds, between llama.cpp's
    minimum and s.n_ctx; None when even the minimum does not fit."""
    low = fit_floor(s, n_ctx_train)
    if not fits_at(low):
        return None
    high = max(_pad(s.n_ctx), low)
    while high - low > PAD:
        mid = _pad((low + high) // 2)
        mid = mid if mid < high else high - PAD
        if fits_at(mid):
            low = mid
        else:
            high = mid
    return high if fits_at(high) else low


def _pad(n: int) -> int:
    return -(-n // PAD) * PAD


def type_bytes(name: str, elems: int) -> int:
    """Bytes of `elems` elements of a ggml cache type (f16, q8_0, q4_0, ...)."""
    try:
        qtype = GGMLQuantizationType[name.upper()]
    except KeyError:
        raise ValueError(f"unknown KV cache type {name!r}") from None
    block, size = GGML_QUANT_SIZES[qtype]
    return elems * size // block


def layer_bytes(shape: dict, s: KvSettings) -> list[int]:
    """KV bytes of each layer at settings `s` (shape: tensors.model_shape())."""
    n_ctx = _pad(max(s.n_ctx, 1))
    n_stream = 1 if s.unified else s.n_seq
    n_ctx_seq = n_ctx if s.unified else _pad(n_ctx // s.n_seq)
    swa_cells = n_ctx_seq if s.swa_full else \
        _pad(min(n_ctx_seq, shape["n_swa"] * (s.n_seq if s.unified else 1) + s.n_ubatch))
    out = []
    for il in range(shape["n_layers"]):
        cells = (swa_cells if shape["swa_layers"][il] else n_ctx_seq) * n_stream
        out.append(cells * (type_bytes(s.type_k, shape["k_elems_layer"][il])
                            + type_bytes(s.type_v, shape["v_elems_layer"][il])))
    return out
