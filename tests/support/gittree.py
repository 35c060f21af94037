"""A folder committed as a git repository: a tree build.sh can check out and build."""

from __future__ import annotations

import subprocess
from pathlib import Path


def commit_all(root: Path, message: str = "tiny") -> str:
    """`git init` in `root` (if needed), commit everything in it, return the commit id."""
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", message], check=True)
    return subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
