"""Defaults of the toolchain role (see README.md)."""

# --- packages per package manager -------------------------------------------------------------
toolchain_apt_packages = ("cmake", "g++", "git", "curl", "ca-certificates", "ninja-build")
toolchain_dnf_packages = ("cmake", "gcc-c++", "git", "curl", "ca-certificates", "ninja-build")
toolchain_python_package = "python3"  # on a host whose model copy others fetch tensors from
toolchain_brew_packages = ("cmake", "git", "ninja")
# network.transport: ssh on a Debian orchestrator with root: its forwards' DynamicUser by name.
toolchain_nss_systemd_package = "libnss-systemd"
toolchain_ccache_package = "ccache"

# --- what a GPU backend adds, per package manager (building and running) -------------------------
# Vulkan: the loader and its headers, glslc (shaders are compiled at build time), SPIRV-Headers
# (llama.cpp's docs/build.md: not always pulled in by the loader's dev package), Mesa's drivers
# (lavapipe on a CPU, RADV, ANV) and vulkaninfo. Debian/Ubuntu as the docs name them; Fedora's
# names (spirv-headers-devel per the same docs); Termux's from termux-packages (vulkan-loader-
# android wraps the phone's own libvulkan, glslc comes with shaderc).
# CUDA: Debian's and Ubuntu's toolkit (Debian: contrib and non-free, Ubuntu: multiverse); elsewhere the
# toolkit comes from NVIDIA and must be there (toolchain's preflight). ROCm: Debian's HIP
# compiler and BLAS libraries and rocminfo (rocm_agent_enumerator); llama.cpp's preflight
# refuses a HIP older than the pinned tree needs.
toolchain_backend_packages = {
    "apt": {"vulkan": ("libvulkan-dev", "glslc", "mesa-vulkan-drivers", "vulkan-tools",
                       "spirv-headers"),
            "cuda": ("nvidia-cuda-toolkit",),
            "rocm": ("hipcc", "libhipblas-dev", "librocblas-dev", "rocminfo")},
    "dnf": {"vulkan": ("vulkan-loader-devel", "glslc", "mesa-vulkan-drivers", "vulkan-tools",
                       "spirv-headers-devel")},
}
# Termux and dnf (no package database fact): the backend's packages count as present when its
# tool is on PATH (glslc); else Termux installs these (pkg install is idempotent).
toolchain_termux_backend = {"vulkan": ("shaderc", "vulkan-headers", "vulkan-loader-android",
                                       "vulkan-tools", "spirv-headers")}
toolchain_backend_tool = {"vulkan": "glslc"}
# What a host that copies a GPU build needs to run it (apt): the Vulkan loader and Mesa's
# drivers; CUDA's and ROCm's runtime libraries come with the toolkit packages above.
toolchain_apt_copier_backend = {"vulkan": ("libvulkan1", "mesa-vulkan-drivers"),
                                "cuda": ("nvidia-cuda-toolkit",),
                                "rocm": ("hipcc", "libhipblas-dev", "librocblas-dev")}
# The apt components each distribution's CUDA toolkit needs (Debian's wiki, Ubuntu's archive).
# Debian: nvidia-cuda-toolkit is in non-free, and what it pulls in (nvidia-cuda-dev needs
# libcuda1, which needs nvidia-support and glx-alternative-nvidia) in contrib: with non-free
# alone apt finds no solution (seen on Debian 13).
toolchain_cuda_components = {"debian": ("contrib", "non-free"), "ubuntu": ("multiverse",)}
# A toolkit already on PATH (NVIDIA's or AMD's own installer) stands for the distribution's.
toolchain_toolkit_tools = {"nvidia-cuda-toolkit": "nvcc", "hipcc": "hipcc"}

# --- a builder that cross-compiles for hosts of another architecture (llama_cpp/keys.py) -------
# Debian's cross compiler for each (its machine, as `uname -m` says it): g++ for the target, and
# the target's C library and headers built for it (gcc only recommends them, and apt installs no
# recommends here). OpenMP (libgomp1-arm64-cross) comes with the compiler.
toolchain_apt_cross_packages = {"aarch64": ("g++-aarch64-linux-gnu", "libc6-dev-arm64-cross")}

# --- a copier on apt (the llama_cpp run's build_copiers: it copies its build, compiles none) --
# What running and copying the build needs there, from what runs on such a host:
# curl: llama_cpp's copy.sh fetches the tarball from the builder's md-share (tar, gzip and
#   sha256sum, which it also runs, are Debian's essential packages); the models role downloads
#   and the services role's health check use it too;
# ca-certificates: curl's https (a host of a model's first llama-server downloads it from the Hub);
# libgomp1: the binaries link OpenMP (ggml's GGML_OPENMP, on by default); a full toolchain gets it
#   with gcc, a copier has no gcc to bring it. libstdc++6 and libgcc-s1 are there with apt itself.
toolchain_apt_copier_packages = ("curl", "ca-certificates", "libgomp1")
# The host that resolves the ref (the first of the run) runs git ls-remote (llama_cpp.resolve,
# and the plan's RemoteRef probe), copier or not.
toolchain_apt_git_package = "git"
# A host md-rpc-seed runs on compiles it with cc (rpc_cache.seed_tool): gcc gives cc, libc6-dev
# the headers (gcc only recommends it, and apt installs no recommends here).
toolchain_apt_seed_packages = ("gcc", "libc6-dev")

# --- Termux (`pkg`, no root): the tool meshdeploy looks for on PATH -> the package that brings it
# clang gives cc and c++; getconf counts the cores for a build's -j (build.sh); util-linux brings
# flock and setsid, without which a long step runs unguarded (core/inflight.py).
toolchain_termux_packages = {"cmake": "cmake", "c++": "clang", "git": "git", "curl": "curl",
                             "ninja": "ninja", "getconf": "getconf", "flock": "util-linux",
                             "setsid": "util-linux"}
toolchain_termux_ccache = {"ccache": "ccache"}
toolchain_termux_python = {"python3": "python"}

# --- hosts without root that are not Termux: nothing can be installed there, so a package counts
# as present when its tool is on PATH (a user's own cmake from pip, say) or dpkg lists it. None:
# no tool stands for it (checked through dpkg alone, where there is dpkg).
toolchain_package_tools = {"cmake": "cmake", "g++": "c++", "gcc-c++": "c++", "git": "git",
                           "curl": "curl", "ca-certificates": None, "ninja-build": "ninja",
                           "ccache": "ccache", "python3": "python3", "libgomp1": None,
                           "gcc": "cc", "libc6-dev": None, "glslc": "glslc",
                           "vulkan-tools": "vulkaninfo", "nvidia-cuda-toolkit": "nvcc",
                           "hipcc": "hipcc", "rocminfo": "rocminfo"}

# --- preflight ----------------------------------------------------------------------------------
# llama.cpp's top-level CMakeLists.txt: cmake_minimum_required(VERSION 3.14)
toolchain_cmake_min = (3, 14)

# --- apt proxy ----------------------------------------------------------------------------------
toolchain_apt_proxy_file = "/etc/apt/apt.conf.d/90meshdeploy-proxy"
