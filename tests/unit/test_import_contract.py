"""The dependency rules of pyproject.toml's [tool.importlinter] hold for this tree.

lint-imports comes from the `test` extras (import-linter), next to the interpreter running the
tests; the tree under test goes first on PYTHONPATH, so an editable install of another checkout
is not what gets analysed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    assert lint.exists(), f"{lint} is missing: install the test extras (pip install -e '.[test]')"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([str(lint), "--no-cache", "--config", str(ROOT / "pyproject.toml")],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(ROOT / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    assert f"Contracts: {len(contracts)} kept, 0 broken." in done.stdout, done.stdout


def test_the_layers_acyclic_and_role_contracts_are_declared():
    with open(ROOT / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    kinds = {c["type"] for c in contracts}
    assert {"layers", "acyclic_siblings", "independence"} <= kinds, kinds
    layers = next(c for c in contracts if c["type"] == "layers")
    assert layers.get("exhaustive") is True, "a new folder of meshdeploy/ must be placed"
