"""Long remote steps (downloads, builds, seeding) that outlive the run which started them.

A command over SSH without a terminal is not stopped when meshdeploy dies: the remote shell
gets no SIGHUP, so a download or build of a killed (or interrupted) apply runs on, orphaned, and
would race the next apply's writes to the same partial file, build tree or cache entry. So each
such step runs guarded on its host:

- under an exclusive flock(1) on <run>/steps/<name>.lock, held by the step's own processes
  (not by the SSH session): a second run of the same step waits until the first one ended,
  however it ended, and never writes beside it;
- in a session of its own (setsid), whose id it records in <name>.pid: `stop_script` ends every
  step still holding its lock (SIGTERM to its process group, SIGKILL after a grace period).
  meshdeploy runs it when it takes over a dead run's host lock, and on a second Ctrl-C.

Every guarded step is also written to be safe to repeat and to stop at any point: it works under
a temporary name and renames only what is complete and verified.

<run> is the host's run folder (Layout.run): /run/meshdeploy on a host with root, the login user's
$XDG_RUNTIME_DIR/meshdeploy (or a folder under its cache) on a rootless one; the steps of a run
on a host are guarded and stopped in the same folder, so callers pass the host's layout.

Hosts without flock and setsid (macOS) run the step unguarded. A lock left by a reboot is held by
no process: flock, not the file's presence, says a step runs (and /run is empty after a reboot).
"""

from __future__ import annotations

import re

from meshdeploy.config.model import Layout
from meshdeploy.core import shell

STEPS_DIR = "/run/meshdeploy/steps"  # on a host with root (system_layout's run folder)
GRACE = 20  # seconds a stopped step gets to exit on SIGTERM before SIGKILL

_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


def lock_name(slot: str) -> str:
    """A file name for a step's address: `models.gguf[gemma]` -> `models.gguf-gemma-`."""
    return _SLUG.sub("-", slot)


def steps_dir(layout: Layout | None = None) -> str:
    """The folder of the steps' locks on a host with this layout (None: a host with root)."""
    return STEPS_DIR if layout is None or not layout.rootless else f"{layout.run}/steps"


def guarded(slot: str, body: str, layout: Layout | None = None) -> str:
    """`body` run as the step `slot` on a host with `layout` (None: a host with root): never
    beside another run of the same step, in a session `stop_script` can end. Its exit status
    and standard input are the body's."""
    return shell.assign_text("BODY", body) + "\n" + shell.template(
        shell.TEMPLATES / "step-guard.sh", DIR=steps_dir(layout), NAME=lock_name(slot),
        SLOT=slot)


def stop_script(grace: int = GRACE, layout: Layout | None = None) -> str:
    """End every guarded step still running on a host with `layout` (as the user its steps run
    as: root, or a rootless host's login user); prints what it stopped."""
    return shell.template(shell.TEMPLATES / "step-stop.sh", DIR=steps_dir(layout),
                          GRACE=int(grace))


def parse_stopped(lines) -> list[str]:
    """The steps stop_script reports it ended (their addresses, e.g. `llama_cpp.build`)."""
    return [line.split(" ", 2)[2].strip() for line in lines
            if line.startswith("stopped ") and len(line.split(" ", 2)) == 3]
