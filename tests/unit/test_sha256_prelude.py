"""md_sha256 (core.shell.SHA256), the hasher of every script that verifies a download, a model or
a build copy: OpenSSL's where the host has it, else sha256sum; each gives the digest Python
computes, an OpenSSL that answers no digest falls back, and a missing file gives no digest."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.require import needs

from meshdeploy.core import shell


def sha256(path: Path, tools: Path | None = None) -> str:
    env = dict(os.environ)
    if tools is not None:
        env["PATH"] = str(tools)
    script = shell.script('md_sha256 "$F"', prelude=shell.SHA256, F=str(path))
    proc = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, env=env,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def only(tmp_path: Path, *names: str) -> Path:
    """A PATH folder holding just these commands (links to the machine's)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).symlink_to(shutil.which(name))
    return folder


@pytest.fixture
def blob(tmp_path) -> tuple[Path, str]:
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(3 << 20) + b"tail")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


@needs("openssl")
def test_openssl_gives_the_digest(tmp_path, blob):
    path, digest = blob
    assert sha256(path, only(tmp_path, "openssl", "cut")) == digest + "\n"


def test_without_openssl_sha256sum_gives_it(tmp_path, blob):
    path, digest = blob
    assert sha256(path, only(tmp_path, "sha256sum", "cut")) == digest + "\n"


def test_an_openssl_that_answers_no_digest_falls_back_to_sha256sum(tmp_path, blob):
    path, digest = blob
    tools = only(tmp_path, "sha256sum", "cut")
    fake = tools / "openssl"  # an OpenSSL without `dgst -r`: usage on stderr, exit 1
    fake.write_text("#!/bin/sh\necho 'dgst: Unknown option -r' >&2\nexit 1\n")
    fake.chmod(0o755)
    assert sha256(path, tools) == digest + "\n"


def test_a_missing_file_gives_no_digest(tmp_path):
    assert sha256(tmp_path / "absent") == "\n"
