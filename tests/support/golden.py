"""Golden files: compare rendered text with the stored one; MESHDEPLOY_UPDATE_GOLDEN=1 rewrites."""

from __future__ import annotations

import os
from pathlib import Path


def check(golden: Path, text: str) -> None:
    """Assert `text` equals `golden` (written first when MESHDEPLOY_UPDATE_GOLDEN=1)."""
    if os.environ.get("MESHDEPLOY_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}: run with MESHDEPLOY_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{golden} differs: review, then MESHDEPLOY_UPDATE_GOLDEN=1"
