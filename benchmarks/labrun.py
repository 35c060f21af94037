"""What the scripts that apply a cluster on a lab of their own share: meshdeploy run as a user
runs it, printed with its exit code and time, and the lab brought up, used and taken down."""

from __future__ import annotations

import subprocess
import sys
import time


def meshdeploy(*args: str) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "meshdeploy", *args], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL)
    print(f"\n$ meshdeploy {' '.join(args)}  -> {done.returncode} in "
          f"{time.monotonic() - started:.0f} s", flush=True)
    return done


def failed(script: str, what: str, done: subprocess.CompletedProcess) -> None:
    """Print the end of `done`'s output and exit 1, naming `script` and the step."""
    print(done.stdout[-6000:], done.stderr[-4000:], sep="\n")
    sys.exit(f"{script}: {what} failed")


def on_lab(handle, run, keep: bool) -> int:
    """`run(info)` on lab `handle` brought up for it, taken down afterwards unless `keep`."""
    started = time.monotonic()
    info = handle.up()
    print(f"lab {handle.name} up in {time.monotonic() - started:.0f} s", flush=True)
    try:
        return run(info)
    finally:
        if not keep:
            handle.down()
