"""Running a host's scripts as a user without root, for tests of hosts without root: nobody when
the tests run as root, else the tests' own user (who has no root either)."""

from __future__ import annotations

import os
import pwd
import tempfile
from pathlib import Path

from support.require import require


def as_user(argv: list[str]) -> list[str]:
    """argv run as nobody when this process is root (else as this process's own user)."""
    if os.geteuid() != 0:
        return argv
    require("setpriv")
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *argv]


def give(path: Path) -> None:
    """`path` and everything under it to the user of as_user()."""
    if os.geteuid() != 0:
        return
    nobody = pwd.getpwnam("nobody")
    for p in [path, *path.rglob("*")]:
        os.lchown(p, nobody.pw_uid, nobody.pw_gid)


def owned_folder() -> Path:
    """A new folder the user of as_user() owns and can reach (root's pytest tmp is 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="md-rootless-", dir="/tmp"))
    folder.chmod(0o755)
    give(folder)
    return folder
