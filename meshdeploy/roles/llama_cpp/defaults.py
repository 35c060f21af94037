"""Defaults of the llama_cpp role (see README.md)."""

# --- layout under llama_cpp.prefix ------------------------------------------------------------
# services and status read it too, so it is defined in meshdeploy.core.paths.
from meshdeploy.core.paths import (  # noqa: F401 (this role's variables)
    llama_cpp_build_dir,
    llama_cpp_builds_dir,
    llama_cpp_current_link,
    llama_cpp_src_dir,
)

# --- cmake --------------------------------------------------------------------------------------
# Flags every build gets: RPC on, static binaries, nothing fetched from the network at build
# time (no web UI download), no tests or examples.
llama_cpp_common_cmake_flags = (
    "-DGGML_RPC=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)
llama_cpp_backend_cmake_flags = {
    "cpu": (),
    "cuda": ("-DGGML_CUDA=ON",),
    "metal": ("-DGGML_METAL=ON",),
    "vulkan": ("-DGGML_VULKAN=ON",),
    "rocm": ("-DGGML_HIP=ON",),
}
# Termux (a phone's CPU, built on the phone): GGML_NATIVE's -mcpu=native has given builds that die
# with "Illegal instruction" there (llama.cpp issues #402, #3622: big.LITTLE cores, clang's
# detection); portable code runs on every core. The file's cmake_flags naming GGML_NATIVE win.
llama_cpp_termux_cmake_flags = ("-DGGML_NATIVE=OFF",)
# A build that other hosts copy (keys.py): portable code, never -march=native of the builder's CPU.
# The file's cmake_flags naming GGML_NATIVE win here too.
llama_cpp_portable_cmake_flags = ("-DGGML_NATIVE=OFF",)
# Where a builder keeps the tarball of a build that other hosts copy, under the cmake trees'
# folder (llama_cpp_build_dir): <key>.tar.gz and <key>.tar.gz.sha256.
llama_cpp_share_dir = "share"
# How long a copying host waits for its builder's md-share to serve the archive (the builder
# packs it and starts md-share in the same llama_cpp.copy slot: seconds, normally).
llama_cpp_copy_wait = 300
# A rootless host's CCACHE_DIR, under its cache folder (layout.cache), unless the file sets one.
llama_cpp_rootless_ccache_dir = "ccache"
llama_cpp_server_target = "llama-server"
# The RPC worker's target/binary: ggml-rpc-server in newer trees, rpc-server before.
llama_cpp_rpc_targets = ("ggml-rpc-server", "rpc-server")

# --- lock file ----------------------------------------------------------------------------------
llama_cpp_lock_suffix = ".lock.json"
