"""docs/architecture.md and `meshdeploy resources` show the registry as it is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from meshdeploy.core import registry

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_meshdeploy_resources_prints_every_registered_resource_in_order():
    out = subprocess.run([sys.executable, "-m", "meshdeploy", "resources", "--markdown"],
                         capture_output=True, text=True, check=True).stdout
    rows = re.findall(r"^\| ([a-z_]+\.[a-z_]+)\s+\| roles/([a-z_]+)\s+\|", out, re.M)
    assert rows == [(r.qualified, r.role) for r in registry.resources()]


def test_the_doc_names_every_resource_and_the_command_that_lists_them():
    text = DOC.read_text()
    assert "meshdeploy resources" in text
    missing = [r.qualified for r in registry.resources() if r.qualified not in text]
    assert not missing, f"docs/architecture.md does not mention {missing}"


def test_the_layers_section_names_the_contracts_layers_in_their_order():
    import tomllib

    config = tomllib.loads((DOC.parents[1] / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c["type"] == "layers")
    section = DOC.read_text().split("## Layers\n", 1)[1].split("\n## ", 1)[0]
    drawing = section.split("```", 2)[1]
    positions = []
    for layer in contract["layers"]:
        for name in (n.strip() for n in layer.split("|")):
            found = re.search(rf"meshdeploy/(\S+, )?{re.escape(name)}(/|\.py)", drawing)
            assert found, f"docs/architecture.md's Layers drawing does not name {name}"
            positions.append((found.start(), name))
    assert positions == sorted(positions), "the drawing's order is not the contract's"
