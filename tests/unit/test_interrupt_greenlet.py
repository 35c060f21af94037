"""Ctrl-C under gevent's patch reaches the command's own greenlet, never paramiko's transport.

A plain SIGINT handler raises KeyboardInterrupt wherever the interpreter is; under the patch
that can be a connection's transport "thread" (a greenlet), which dies with it, and whatever the
command then does over that connection (bench's clean-up of its local copy) waits for ever:
seen in CI as paramiko's Thread-1 traceback and a bench still running 120 s after Ctrl-C.
common.interrupts_in_main_greenlet() moves the interrupt to the main greenlet. The script below
stands a busy greenlet in for the transport and sends itself SIGINT while it runs; without the
handler the transport dies (the failure), with it the transport lives and main is interrupted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import as_at_a_terminal

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from gevent import monkey; monkey.patch_all()
import gevent, os, signal, time
if sys.argv[1] == "handled":
    from meshdeploy.commands.common import interrupts_in_main_greenlet
    interrupts_in_main_greenlet()
def transport():
    os.kill(os.getpid(), signal.SIGINT)  # arrives while this greenlet runs
    for _ in range(5):
        time.sleep(0.05)
    print("transport alive", flush=True)
g = gevent.spawn(transport)
try:
    gevent.sleep(3)
    print("main not interrupted", flush=True)
except KeyboardInterrupt:
    print("main interrupted", flush=True)
g.join()
"""


@pytest.mark.parametrize("mode, transport_lives", [("plain", False), ("handled", True)])
def test_ctrl_c_goes_to_the_main_greenlet_and_leaves_the_transport_alive(mode, transport_lives):
    # SIGINT as at a terminal: a test process may have it ignored (a pytest-xdist worker, a run
    # started in the background), and a child that inherits that gets no KeyboardInterrupt.
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, preexec_fn=as_at_a_terminal)
    lines = done.stdout.splitlines()
    assert "main interrupted" in lines, done.stdout + done.stderr
    assert ("transport alive" in lines) == transport_lives, done.stdout + done.stderr
    if not transport_lives:
        assert "failed with KeyboardInterrupt" in done.stderr
