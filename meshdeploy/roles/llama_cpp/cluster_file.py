"""The llama_cpp role's part in loading a cluster file (registry.file_hooks): what its
schema.json cannot say of llama_cpp.ref, checked beside every other check (a schema error would
stop the file's other problems from being said)."""

from __future__ import annotations

import re

from meshdeploy.config.document import Document
from meshdeploy.config.model import Cluster
from meshdeploy.errors import ConfigIssue
from meshdeploy.roles.llama_cpp import settings

ABBREVIATED_COMMIT = re.compile(r"[0-9a-f]{7,39}")


def validate(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    ref = settings.of(cluster).ref
    if ABBREVIATED_COMMIT.fullmatch(ref):
        return [doc.issue((settings.ROLE, "ref"), f"'{ref}' looks like an abbreviated commit",
                          "write the full 40-hex commit (git rev-parse), or a tag: a short hash "
                          "cannot be fetched reliably and may become ambiguous")]
    return []
