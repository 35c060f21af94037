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
# time (no web UI download), no tests or examples. Every switch the tree would otherwise turn on
# or off by what the building host has installed is set, so one build key is one build wherever
# it compiles (read in the b11312 tree's CMakeLists): LLAMA_OPENSSL (cpp-httplib links OpenSSL
# when found), LLAMA_CURL (older trees link libcurl when found), LLAMA_USE_PREBUILT_UI
# (downloads the web UI when online), GGML_RPC_RDMA (ggml-rpc/CMakeLists.txt turns RDMA on when
# libibverbs is found), GGML_OPENMP (below: per kernel) and the backends' own (below).
llama_cpp_common_cmake_flags = (
    "-DGGML_RPC=ON",
    "-DGGML_RPC_RDMA=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)
# GGML_OPENMP is on by default and falls back to ggml's own threads, with a warning, where cmake
# finds no OpenMP (ggml/src/CMakeLists.txt). On Linux the toolchain brings it (g++ -> libgomp;
# Termux's clang ships LLVM's libomp) and build.sh stops when cmake did not find it; Apple's
# clang has none, so macOS builds set it off rather than depend on a Homebrew libomp.
llama_cpp_openmp_cmake_flags = {"Linux": ("-DGGML_OPENMP=ON",),
                                "Darwin": ("-DGGML_OPENMP=OFF",)}
llama_cpp_backend_cmake_flags = {
    "cpu": (),
    # GGML_CUDA_NCCL (on by default) links NCCL where it is installed; the hosts that copy a
    # build have none. The file's cmake_flags can turn it on.
    "cuda": ("-DGGML_CUDA=ON", "-DGGML_CUDA_NCCL=OFF"),
    "metal": ("-DGGML_METAL=ON",),
    "vulkan": ("-DGGML_VULKAN=ON",),
    "rocm": ("-DGGML_HIP=ON",),
}
# Termux (a phone's CPU, built on the phone): GGML_NATIVE's -mcpu=native has given builds that die
# with "Illegal instruction" there (llama.cpp issues #402, #3622: big.LITTLE cores, clang's
# detection); portable code runs on every core. The file's cmake_flags naming GGML_NATIVE win.
llama_cpp_termux_cmake_flags = ("-DGGML_NATIVE=OFF",)
# The GPU code a build compiles for (keys.gpu_code): CMAKE_CUDA_ARCHITECTURES and GPU_TARGETS.
# Unset, the tree picks them by what the building host has: "native" (the GPUs present) for
# CUDA with GGML_NATIVE, every GPU of the system for HIP (docs/build.md), so they are always set.
llama_cpp_gpu_code_flags = {"cuda": "CMAKE_CUDA_ARCHITECTURES", "rocm": "GPU_TARGETS"}
# ggml/src/ggml-hip/CMakeLists.txt (b10454 and b11312): "At least ROCM/HIP V6.1 is required".
llama_cpp_hip_min = (6, 1)
# A build that other hosts with other CPUs copy (keys.py): portable code, never -march=native of
# the builder's CPU. The file's cmake_flags naming GGML_NATIVE win here too.
llama_cpp_portable_cmake_flags = ("-DGGML_NATIVE=OFF",)
# On x86-64, GGML_NATIVE=OFF alone still assumes AVX2/FMA/F16C (SIGILL on older CPUs, AVX-512
# unused on newer ones): llama.cpp's runtime CPU dispatch builds every x86 level as
# libggml-cpu-<variant>.so and loads the best one the CPU runs (ggml/src/CMakeLists.txt,
# GGML_CPU_ALL_VARIANTS). Its libraries are shared; their RPATH is $ORIGIN, so the binaries find
# them beside themselves wherever the build is installed or copied (build.sh copies and checks).
llama_cpp_dispatch_cmake_flags = ("-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON",
                                  "-DGGML_CPU_ALL_VARIANTS=ON", "-DBUILD_SHARED_LIBS=ON",
                                  "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON")
llama_cpp_dispatch_machines = ("x86_64", "amd64")
# Cross-compiling (keys.py): the architectures whose builds a host of another one compiles,
# each with its GNU triplet (Debian's cross compilers are <triplet>-gcc and <triplet>-g++, their
# C library and headers under /usr/<triplet>), and the machines that cross-compile for them and
# the backends they do it for. A CPU build only: a GPU backend's libraries and shader compilers
# for another architecture are not set up (a Vulkan arm64 host compiles its own).
llama_cpp_cross_triplets = {"aarch64": "aarch64-linux-gnu"}
llama_cpp_cross_from = ("x86_64",)
llama_cpp_cross_backends = ("cpu",)
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
