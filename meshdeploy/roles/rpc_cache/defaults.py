"""Defaults of the rpc_cache role (see README.md)."""

from meshdeploy.core.paths import rpc_cache_dir

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

# rpc-server keeps its entries under $LLAMA_CACHE/rpc; services.rpc_server sets LLAMA_CACHE to
# the unit's CacheDirectory: /var/cache/meshdeploy-rpc-<port>/rpc (meshdeploy.core.paths).
cache_dir_for = rpc_cache_dir
