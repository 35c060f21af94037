"""The one way tests run the `meshdeploy` command line: a child process, as a user runs it.

Every run prints its command line, exit code and time, and the tail of its output, so a failing
test's captured output tells what meshdeploy said.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def as_at_a_terminal() -> None:
    """preexec_fn for a command a test interrupts with SIGINT as Ctrl-C would: SIGINT and
    SIGQUIT back to their defaults. A test run started in the background by a shell without job
    control (`.ci/run &`) inherits them ignored, exec keeps them ignored, and Python then
    installs no KeyboardInterrupt handler: `logs -f` never saw the Ctrl-C (it hung in every such
    run, and exited in 0.5 s with the defaults)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def meshdeploy(*args, timeout: float = 3600, env: dict | None = None,
               cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """`python -m meshdeploy ARGS` with no terminal on stdin; `env` replaces the environment
    when given. The result carries `.seconds`, the run's wall time."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "meshdeploy", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd,
                          stdin=subprocess.DEVNULL)
    proc.seconds = time.monotonic() - started
    print(f"$ meshdeploy {' '.join(map(str, args))}  -> {proc.returncode} in {proc.seconds:.1f} s")
    print(proc.stdout[-6000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    return proc
