"""`status` with a host or a service away: the rows, the verdict and its exit code; and the
rpc-server probe, run for real against loopback listeners shaped as ggml-rpc listens
(listen(fd, 1), one client served at a time), never taking a place in their backlog."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading

import pytest

from meshdeploy import errors
from meshdeploy.commands import status
from meshdeploy.views import status as view


def hello(port: int) -> str:
    """status's rpc-server probe, as a worker runs it (python3 -c HELLO ADDRESS PORT)."""
    done = subprocess.run([sys.executable, "-c", status.HELLO, "127.0.0.1", str(port)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def queued(port: int) -> int:
    """The connections waiting in the accept queue of the listener on `port` (the kernel's
    own count: ss's Recv-Q of a listener)."""
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            for row in f.read().splitlines()[1:]:
                w = row.split()
                if w[3] == "0A" and int(w[1].rsplit(":", 1)[1], 16) == port:
                    return int(w[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on {port}")


@pytest.fixture
def in_use():
    """A listener as ggml-rpc's (backlog 1) whose one client is being served: accepted and
    held, as a llama-server holds its workers. Gives (listener, port, clients)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    clients = [client, served]
    yield listener, port, clients
    for s in clients:
        s.close()
    listener.close()


def test_a_worker_in_use_is_busy_and_the_probe_takes_no_place_in_its_backlog(in_use):
    """The llama-server reconnecting to a worker needs the one free place of its backlog: the
    probe reads the socket table instead of connecting (it used to connect, and its closed
    connection stayed queued until rpc-server accepted again)."""
    listener, port, _ = in_use
    assert queued(port) == 0
    answer = hello(port)
    assert answer.split()[0] == "busy", answer
    assert queued(port) == 0, "the probe's connection waits in rpc-server's backlog"
    row = status.rpc_row("node2", f"{port} active {answer}")
    assert row["healthy"] and row["answer"] == "listening (in use by 127.0.0.1)", row


def test_a_worker_whose_backlog_is_full_is_busy_not_down(in_use):
    """What status showed under network.transport: ssh: rpc-server serving llama-server, two
    probe connections queued (Recv-Q 2 on a backlog of 1); the kernel drops every further SYN,
    so a connect times out. That is a worker in use, not one that does not listen."""
    listener, port, clients = in_use
    clients += [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    assert queued(port) == 2
    answer = hello(port)
    row = status.rpc_row("node2", f"{port} active {answer}")
    assert row["answer"] != "not listening" and row["healthy"], row
    assert row["answer"] == "listening (in use by 127.0.0.1); 2 connection(s) queued"


def test_where_no_socket_table_is_readable_a_timeout_is_busy(in_use):
    """macOS or Android (no /proc/net/tcp to read): the probe connects, and a connect that
    times out in a full backlog is `busy`; only a refused one is `down`."""
    listener, port, clients = in_use
    clients += [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    script = status.HELLO.replace('("/proc/net/tcp", "/proc/net/tcp6")', '("/nonexistent",)')
    assert script != status.HELLO
    done = subprocess.run([sys.executable, "-c", script, "127.0.0.1", str(port)],
                          capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "busy", done.stdout + done.stderr
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed = free.getsockname()[1]
    free.close()
    done = subprocess.run([sys.executable, "-c", script, "127.0.0.1", str(closed)],
                          capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "down"


def test_a_free_worker_answers_the_hello_and_a_closed_port_is_down():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        with conn:
            command = conn.recv(1 + 8 + 24, socket.MSG_WAITALL)
            assert command[0] == 14  # HELLO
            conn.sendall(struct.pack("<Q", 3) + bytes([3, 0, 0]))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        answer = hello(port)
    finally:
        thread.join(5)
        listener.close()
    assert answer == "3.0.0 peers=- queued=0"
    row = status.rpc_row("node2", f"{port} active {answer}")
    assert row["healthy"] and row["answer"] == "protocol 3.0.0" and row["protocol"] == "3.0.0"
    down = status.rpc_row("node2", f"{port} active {hello(port)}")
    assert (down["answer"], down["healthy"]) == ("not listening", False)


def test_connections_queued_that_nobody_accepts_are_a_stalled_worker():
    """A listener that accepts nobody while connections wait: an rpc-server that hangs, which a
    probe from outside cannot tell from one in use."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    waiting = socket.create_connection(("127.0.0.1", port))
    try:
        answer = hello(port)
    finally:
        waiting.close()
        listener.close()
    row = status.rpc_row("node2", f"{port} active {answer}")
    assert answer.split()[0] == "queued" and not row["healthy"], row
    assert row["answer"] == "listening, 1 connection(s) queued and none accepted"


# -- the verdict ---------------------------------------------------------------------------------

def _row(host, service, healthy, **more):
    return {"host": host, "service": service, "unit": "active", "answer": "", "protocol": None,
            "healthy": healthy, **more}


SERVER = _row("node1", "llama-server main", True)
WORKER = _row("node2", "rpc-server :50052", True)


@pytest.mark.parametrize("rows, state, code", [
    ([SERVER, WORKER], "healthy", errors.OK),
    # A worker away while its server answers (/health, or the failover's placement): degraded.
    ([SERVER, {**WORKER, "healthy": False}], "degraded", errors.DEGRADED),
    ([SERVER, WORKER, status.unreachable_row("node3", "timed out")], "degraded",
     errors.DEGRADED),
    ([{**SERVER, "healthy": False}, WORKER], "down", errors.DOWN),
    # The server's own host cannot be reached: nothing says it answers.
    ([WORKER, status.unreachable_row("node1", "connection refused")], "down", errors.DOWN),
])
def test_the_verdict_tells_healthy_degraded_and_down_apart(rows, state, code):
    assert status.verdict(rows, ["main"]) == state
    assert status.EXIT[state] == code


def test_a_server_left_out_by_limit_does_not_count():
    assert status.verdict([WORKER], []) == "healthy"


def test_an_unreachable_host_is_one_row_in_text_and_json():
    import json

    rows = [SERVER, WORKER, status.unreachable_row("node3", "timed out")]
    text = view.render_text(rows, status.verdict(rows, ["main"]))
    line = next(li for li in text.splitlines() if li.startswith("node3"))
    assert "unreachable: timed out" in line and line.split()[-1] == "NO"
    assert text.splitlines()[-1] == ("Status: degraded (every llama-server answers, but not "
                                     "everything is there); unreachable: node3")
    (away,) = [r for r in json.loads(view.render_json(rows)) if r["host"] == "node3"]
    assert away == {"host": "node3", "service": "-", "unit": "unknown",
                    "answer": "unreachable: timed out", "protocol": None, "healthy": False,
                    "reachable": False}


def test_exit_codes_are_named_and_distinct():
    assert (errors.EXIT_CODES["DEGRADED"], errors.EXIT_CODES["DOWN"]) == (9, 10)
    assert len(set(errors.EXIT_CODES.values())) == len(errors.EXIT_CODES)


def test_a_host_lost_while_it_is_asked_is_unreachable():
    """A connection that ends while the host's probe runs (the host went away) is said as
    such, not as unreadable output; a host that could not be reached at all is a row too."""
    from pathlib import Path

    from meshdeploy.core.loading import load_cluster

    cluster = load_cluster(Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml")

    class Session:
        unreachable = {"node3": "timed out"}

        def __init__(self):
            self.cluster = cluster

        def hosts(self):
            return cluster.hosts

        def run(self, name, script, sudo=None):
            raise EOFError()

        def connection_lost(self, name):
            return name == "node2"

    rows = {r["host"]: r for r in status.collect(Session())}
    assert rows["node2"]["answer"].startswith("unreachable: connection lost: ")
    assert rows["node3"]["answer"] == "unreachable: timed out"
    assert rows["node1"]["answer"].startswith("status output unreadable: EOFError")
    assert status.verdict(list(rows.values()), ["main"]) == "down"
