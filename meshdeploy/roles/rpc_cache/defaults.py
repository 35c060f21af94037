"""Defaults of the rpc_cache role (see README.md)."""

from meshdeploy.core.paths import rpc_cache_dir

# --- what rpc-server caches (ggml-rpc.cpp, RPC protocol v7) ---------------------------------------
# rpc_use_hash_cache(): weights with size > 10 MiB travel as an FNV-1a hash first.
rpc_cache_hash_threshold = 10 * 1024 * 1024

# --- the seeding tool ---------------------------------------------------------------------------
rpc_cache_tools_dir = "tools"                  # under llama_cpp.prefix
rpc_cache_tool_name = "md-rpc-seed"
rpc_cache_tool_cc = "cc -O2"
# Next to the binary: sha256 of the source it was compiled from, written only after a good build.
rpc_cache_tool_source_suffix = ".source-sha256"
# In the cache dir: "<gguf sha256> <offset> <size> <16hex>" per seeded tensor.
rpc_cache_marker = ".meshdeploy-seeded"

# --- model distribution: workers fetch their tensors from the cluster's copy ------------------
# Beside the GGUF on the host whose copy others fetch from, made once from the verified file:
# "<gguf sha256> <offset> <size> <16hex fnv> <sha256>" per hashed tensor.
rpc_cache_digests_suffix = ".tensors"
rpc_cache_fetch_attempts = 3                   # per tensor, each a fresh ranged GET
rpc_cache_fetch_lanes = 4                      # tensors fetched and hashed at once (<= cores)
rpc_cache_disk_headroom_bytes = 512 * 1024 * 1024  # left free in Layout.cache after seeding

# --- reading a remote GGUF header ------------------------------------------------------------------
rpc_cache_header_first_fetch = 1024 * 1024     # grown x4 until the tensor infos are complete
rpc_cache_header_local_first = 16 * 1024 * 1024  # the same from a local file: one parse, mostly
rpc_cache_header_max = 512 * 1024 * 1024       # a header past this is not a model meshdeploy reads
rpc_cache_http_timeout = 60

# --- placement -----------------------------------------------------------------------------------
# Room left on every device for llama.cpp's compute buffers and backend overhead.
rpc_cache_compute_headroom_bytes = 512 * 1024 * 1024

# rpc-server keeps its entries under $LLAMA_CACHE/rpc; services.rpc_server sets LLAMA_CACHE to
# the unit's CacheDirectory: /var/cache/meshdeploy-rpc-<port>/rpc (meshdeploy.core.paths).
cache_dir_for = rpc_cache_dir
