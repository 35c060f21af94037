"""Defaults of the placement (see README.md)."""

# --- what rpc-server caches (ggml-rpc.cpp, RPC protocol v7) ---------------------------------------
# rpc_use_hash_cache(): weights with size > 10 MiB travel as an FNV-1a hash first, so a cached
# worker is sent only the smaller ones (layers.wire_bytes).
placement_hash_threshold = 10 * 1024 * 1024

# --- reading a remote GGUF header ------------------------------------------------------------------
placement_header_first_fetch = 1024 * 1024     # grown x4 until the tensor infos are complete
placement_header_local_first = 16 * 1024 * 1024  # the same from a local file: one parse, mostly
placement_header_max = 512 * 1024 * 1024       # a header past this is not a model meshdeploy reads
placement_http_timeout = 60

# --- placement -----------------------------------------------------------------------------------
# Room left on every device for llama.cpp's compute buffers and backend overhead.
placement_compute_headroom_bytes = 512 * 1024 * 1024
