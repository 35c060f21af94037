"""Defaults of the toolchain role (see README.md)."""

# --- packages per package manager -------------------------------------------------------------
toolchain_apt_packages = ("cmake", "g++", "git", "curl", "ca-certificates", "ninja-build")
toolchain_dnf_packages = ("cmake", "gcc-c++", "git", "curl", "ca-certificates", "ninja-build")
toolchain_python_package = "python3"  # on a host whose model copy others fetch tensors from
toolchain_brew_packages = ("cmake", "git", "ninja")
# network.transport: ssh on a Debian orchestrator with root: its forwards' DynamicUser by name.
toolchain_nss_systemd_package = "libnss-systemd"
toolchain_ccache_package = "ccache"

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
                           "ccache": "ccache", "python3": "python3"}

# --- preflight ----------------------------------------------------------------------------------
# llama.cpp's top-level CMakeLists.txt: cmake_minimum_required(VERSION 3.14)
toolchain_cmake_min = (3, 14)

# --- apt proxy ----------------------------------------------------------------------------------
toolchain_apt_proxy_file = "/etc/apt/apt.conf.d/90meshdeploy-proxy"
