"""Defaults of the toolchain role (see README.md)."""

# --- packages per package manager -------------------------------------------------------------
toolchain_apt_packages = ("cmake", "g++", "git", "curl", "ca-certificates", "ninja-build")
toolchain_dnf_packages = ("cmake", "gcc-c++", "git", "curl", "ca-certificates", "ninja-build")
toolchain_python_package = "python3"  # on a host whose model copy others fetch tensors from
toolchain_brew_packages = ("cmake", "git", "ninja")
toolchain_ccache_package = "ccache"

# --- preflight ----------------------------------------------------------------------------------
# llama.cpp's top-level CMakeLists.txt: cmake_minimum_required(VERSION 3.14)
toolchain_cmake_min = (3, 14)

# --- apt proxy ----------------------------------------------------------------------------------
toolchain_apt_proxy_file = "/etc/apt/apt.conf.d/90meshdeploy-proxy"
