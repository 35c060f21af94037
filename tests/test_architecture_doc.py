"""docs/architecture.md and `meshdeploy resources` show the registry as it is."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from meshdeploy.deploy import registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


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
