"""docs/architecture.md's resource table is the registry's."""

from __future__ import annotations

import re
from pathlib import Path

from meshdeploy.deploy import registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def test_the_resource_table_lists_every_registered_resource_in_order():
    rows = re.findall(r"^\| ([a-z_]+\.[a-z_]+) \| roles/([a-z_]+) \| (.+?) \|$",
                      DOC.read_text(), re.M)
    want = [(r.qualified, r.role, r.doc + (" (apply only)" if r.apply_only else ""))
            for r in registry.resources()]
    assert rows == want
