"""paramiko's ProxyCommand as the session adjusts it: an exited proxy ends the connection (an
empty read), and the proxy runs in a session of its own (a terminal's Ctrl-C does not reach it)."""

from __future__ import annotations

import os

from meshdeploy.remote.session import adjust_libraries


def test_an_exited_proxy_reads_as_the_end_of_the_connection():
    adjust_libraries()
    from paramiko.proxy import ProxyCommand

    proxy = ProxyCommand("printf abc")
    assert proxy.recv(16) == b"abc"
    assert proxy.recv(16) == b""  # paramiko's own loops here for ever
    proxy.process.wait(timeout=10)


def test_the_proxy_runs_in_a_session_of_its_own():
    adjust_libraries()
    from paramiko.proxy import ProxyCommand

    proxy = ProxyCommand("sleep 30")
    try:
        assert os.getsid(proxy.process.pid) == proxy.process.pid != os.getsid(0)
    finally:
        proxy.close()
        proxy.process.wait(timeout=10)
