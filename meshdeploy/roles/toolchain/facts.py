"""Facts of the toolchain role: what the host is and which build tools it already has."""

from __future__ import annotations

from pyinfra.api import FactBase

from meshdeploy.core import probe, shell
from meshdeploy.roles.toolchain import defaults as d

_TOOLS = ("cmake", "cc", "c++", "g++", "git", "curl", "ninja", "ccache", "nvcc", "nvidia-smi",
          "apt-get", "dnf", "brew", "systemctl", "launchctl", "sha256sum", "shasum", "python3",
          "pkg", "getconf", "flock", "setsid", "glslc", "vulkaninfo", "hipcc")

# Termux: its `pkg` on PATH, and that `pkg` or $PREFIX inside the app's folder (com.termux), or
# TERMUX_VERSION set. `pkg` alone is also FreeBSD's and Solaris's tool, and PREFIX an ordinary
# variable (autotools users set it); TERMUX_VERSION is set in the app's own terminal, but not
# always in an sshd session, whose environment is what the probe sees. No `pkg`: nothing can be
# installed there, whatever else the host is (a Termux-like host without it is rootless Linux).
_TERMUX = ('p=$(command -v pkg 2>/dev/null); case "$p ${PREFIX-}" in */com.termux/*) t=1 ;; '
           '*) t=${TERMUX_VERSION-} ;; esac; [ -n "$p" ] && [ -n "$t" ] && echo termux; ')


# cmake's version: Debian's package database answers for Debian's own /usr/bin/cmake (a third
# of the cost of starting cmake, the probe's most expensive command on a plan of many hosts);
# any other cmake first on PATH (pip's, Kitware's, Homebrew's) is asked itself.
_CMAKE = ('c=$(command -v cmake 2>/dev/null); v=; [ "$c" = /usr/bin/cmake ] && '
          "v=$(dpkg-query -W -f '${db:Status-Abbrev}${Version}' cmake 2>/dev/null); "
          'case "$v" in "ii "?*) v=${v#ii }; v=${v#*:}; echo "cmake version ${v%%[-~+]*}" ;; '
          '*) [ -n "$c" ] && cmake --version 2>/dev/null | head -n 1 ;; esac')


class Platform(FactBase):
    """Kernel, machine, distribution and the tools on PATH.

    ```python
    {"kernel": "Linux", "machine": "x86_64", "distro": "debian", "version": "12",
     "tools": ["cmake", "git"], "cmake_version": (3, 25, 1) or None, "termux": False}
    ```
    termux: the host is Termux (an Android app, no root; packages from `pkg`).
    """

    def command(self):
        tools = " ".join(_TOOLS)
        return ("u=$(uname -s -m); echo \"${u% *}\"; echo \"${u##* }\"; "
                "(. /etc/os-release 2>/dev/null && echo \"$ID $VERSION_ID\") "
                "|| echo 'unknown -'; "
                f"for t in {tools}; do command -v $t >/dev/null 2>&1 && printf '%s ' $t; done; echo; "
                + _TERMUX + _CMAKE)

    def process(self, output):
        kernel, machine, distro_line, tools_line = (output + ["", "", "", ""])[:4]
        distro, _, version = distro_line.partition(" ")
        rest = [line.strip() for line in output[4:]]
        words = next((line.split() for line in rest if line.startswith("cmake ")), [])
        cmake_version = None
        if words[:2] == ["cmake", "version"] and len(words) > 2:
            numbers = tuple(probe.uint(p) for p in words[2].split("-")[0].split(".")[:3])
            cmake_version = None if None in numbers else numbers
        return {"kernel": kernel, "machine": machine, "distro": distro, "version": version,
                "tools": sorted(tools_line.split()), "cmake_version": cmake_version,
                "termux": "termux" in rest}


class DebPackages(FactBase):
    """Installed state of the given Debian packages: {name: True|False}."""

    def command(self, packages):
        return shell.command("dpkg-query", "-W", "-f", "${Package} ${db:Status-Abbrev}\\n",
                             *packages, shell.QUIET, shell.THEN, "true")

    def process(self, output):
        found = {}
        for line in output:
            parts = line.split()
            if len(parts) >= 2:
                found[parts[0]] = parts[1].startswith("ii")
        return found

    @staticmethod
    def default():
        return {}


class AptProxy(FactBase):
    """Content of meshdeploy's apt proxy snippet, or None when absent."""

    def command(self):
        return shell.command("cat", d.toolchain_apt_proxy_file)

    def process(self, output):
        return "\n".join(output) + "\n"


class AptComponents(FactBase):
    """The archive components the host's apt sources enable (one-line `deb` entries and deb822
    `Components:` fields), each once: ["main", "non-free"]. [] where there are none."""

    def command(self):
        return ("grep -hsE '^[[:space:]]*(deb[[:space:]]|Components:)' /etc/apt/sources.list "
                "/etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources || true")

    def process(self, output):
        found = []
        for line in output:
            words = line.split()
            if words and words[0] == "Components:":
                found += words[1:]
            elif words and words[0] == "deb":
                rest = words[1:]
                if rest and rest[0].startswith("["):  # options: [arch=amd64 signed-by=...]
                    while rest and not rest[0].endswith("]"):
                        rest = rest[1:]
                    rest = rest[1:]
                found += rest[2:]  # URI, suite, then the components
        return list(dict.fromkeys(found))

    @staticmethod
    def default():
        return []
