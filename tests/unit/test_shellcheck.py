"""Every shell script meshdeploy ships passes shellcheck as POSIX sh (issue 21: scripts as scripts).

The `*.sh` files under meshdeploy/ are what hosts run: core.shell.template assigns a script's
inputs, quoted, above its body. Hosts' /bin/sh is dash (Debian) or bash-as-sh (macOS), hence
`-s sh`. A finding is fixed, or disabled for the line below a `# shellcheck disable=SCxxxx # why`
directive; shell.body drops directive lines, so hosts never get them. CI sets
MESHDEPLOY_REQUIRE_LAB=1: there a missing shellcheck fails instead of skipping.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from support.require import require

from meshdeploy.core import shell

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshdeploy"
SCRIPTS = sorted(PACKAGE.rglob("*.sh"))
_DISABLE = re.compile(r"#\s*shellcheck\s+disable=")
_JUSTIFIED = re.compile(r"#\s*shellcheck\s+disable=[A-Z0-9,]+\s+#\s*\S")


@pytest.fixture(scope="module")
def shellcheck() -> str:
    path = shutil.which("shellcheck")
    if path is None:
        require("shellcheck")
    return path


def test_the_scripts_are_found():
    # A wrong root would find none and every check below would pass on nothing.
    assert {"build.sh", "step-guard.sh", "download.sh"} <= {p.name for p in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_shellcheck_finds_nothing(shellcheck, script):
    out = subprocess.run([shellcheck, "--shell=sh", "--format=gcc", str(script)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_script_says_what_it_does_and_every_disable_why(script):
    text = script.read_text()
    assert text.startswith("# "), f"{script.name}: no leading comment naming its inputs"
    assert shell.body(script).strip(), f"{script.name}: no body after its leading comment"
    lines = text.splitlines()
    # Why: after the directive (`disable=SC2086 # why`) or on the comment line above it.
    bare = [line for above, line in zip(["", *lines], lines)
            if _DISABLE.search(line) and not _JUSTIFIED.search(line)
            and not (above.lstrip().startswith("#") and not _DISABLE.search(above))]
    assert not bare, f"{script.name}: a disabled check without a reason: {bare}"


def test_every_templates_folder_ships_in_the_package():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data = data.get("package-data", {})
    missing = [".".join(folder.parent.relative_to(ROOT).parts)
               for folder in sorted(PACKAGE.rglob("templates")) if folder.is_dir()]
    missing = [p for p in missing if "templates/*" not in package_data.get(p, [])]
    assert not missing, f"add 'templates/*' to [tool.setuptools.package-data] of {missing}"
