"""What a test needs from this machine: a skip on a developer's machine, a failure under CI.

CI (.ci/run) sets MESHDEPLOY_REQUIRE_LAB=1 and scripts/setup installs every tool named here, so
there a missing tool is a broken install, never a silent skip. Elsewhere the test is skipped with
the package to install.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import pytest

# The Debian package that brings each tool (the skip message names it).
PACKAGES = {"cc": "gcc", "systemd-analyze": "systemd", "runsvdir": "runit", "sv": "runit",
            "svlogd": "runit", "setpriv": "util-linux", "flock": "util-linux",
            "setsid": "util-linux", "curl": "curl", "shellcheck": "shellcheck", "git": "git",
            "ssh-keygen": "openssh-client", "openssl": "openssl", "ss": "iproute2",
            "timeout": "coreutils", "nft": "nftables", "promtool": "prometheus",
            "prometheus": "prometheus",
            "prometheus-blackbox-exporter": "prometheus-blackbox-exporter",
            "aarch64-linux-gnu-g++": "g++-aarch64-linux-gnu",
            "aarch64-linux-gnu-gcc": "gcc-aarch64-linux-gnu",
            "qemu-aarch64-static": "qemu-user-static"}


def required() -> bool:
    """Whether a missing requirement fails (CI) instead of skipping."""
    return os.environ.get("MESHDEPLOY_REQUIRE_LAB") == "1"


def unmet(reason: str) -> None:
    """Skip with `reason`, or fail under CI."""
    if required():
        pytest.fail(f"MESHDEPLOY_REQUIRE_LAB=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def missing(*tools: str) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]


def require(*tools: str) -> None:
    """Skip (fail under CI) unless every tool is on PATH."""
    if gone := missing(*tools):
        packages = sorted({PACKAGES.get(t, t) for t in gone})
        unmet(f"{', '.join(gone)} not installed (Debian: {' '.join(packages)})")


def require_module(name: str, install: str) -> None:
    """Skip (fail under CI) unless the Python module `name` imports; `install`: how to get it."""
    if importlib.util.find_spec(name) is None:
        unmet(f"Python module {name} not installed ({install})")


def needs(*tools: str):
    """Decorator form of require() for a test function (fixtures pass through)."""
    def wrap(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            require(*tools)
            return test(*args, **kwargs)
        return run
    return wrap
