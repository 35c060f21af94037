"""Files meshdeploy writes on the control machine, beside the cluster file: the state, a saved
plan, the lock file, the bench and speed files.

Whoever can write that folder (a shared checkout, a synced folder) can plant a link at any name
in it, so no file there is opened for writing by a name that may already exist: each is made
as a fresh temporary file (mkstemp: O_CREAT|O_EXCL, a name nobody can guess) and renamed over
its name, which replaces a link there and never writes through it. docs/security.md, "Files
the control machine reads back", says what each file is trusted with.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, text: str, mode: int) -> None:
    """`text` into `path`: a temporary file in the same folder, fsync'd, renamed over it; a
    reader sees the old file or the new one, never half of one.

    + mode: the file's mode, set on the open file (a name could be swapped for a link between
      the write and a chmod by name)
    Example: write_atomic(Path("lab.speed.json"), "{}\\n", 0o644)
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)  # umask-independent
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    # The rename is only durable once the directory entry is on disk.
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
