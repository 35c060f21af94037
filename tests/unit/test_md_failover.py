"""md-failover (roles/services/templates/md-failover.py) against real processes on loopback:
stand-in rpc-servers that answer HELLO and serve one client at a time, as rpc-server does, and
a stand-in llama-server that dials every --rpc endpoint, holds the connections and serves
/metrics. The lab test (tests/lab/test_failover_lab.py) runs the real binaries."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "meshdeploy" / "roles" / "services" / "templates" / "md-failover.py"

# The stand-in llama-server: dials each --rpc endpoint (HELLO), holds the connections, writes
# its argv to $FAKE_LOG, answers /metrics, and exits 134 when a worker closes its end (as
# llama-server aborts on "Remote RPC server crashed").
FAKE = r'''
import http.server, json, os, socket, socketserver, struct, sys, threading, time
args = sys.argv[1:]
rpc = args[args.index("--rpc") + 1].split(",") if "--rpc" in args else []
port = int(args[args.index("--port") + 1])
host = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--host"][-1]  # the last wins
# ggml-rpc asks each worker once at start (device memory), closes, and connects again to load:
# a copy of the first connection kept open elsewhere would leave the second waiting for ever.
for t in rpc:
    a, _, p = t.rpartition(":")
    s = socket.create_connection((a, int(p)), timeout=float(os.environ.get("FAKE_CONNECT", "5")))
    s.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))
    s.recv(64)
    time.sleep(1.5)
    s.close()
conns = []
for t in rpc:
    a, _, p = t.rpartition(":")
    s = socket.create_connection((a, int(p)), timeout=5)
    s.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))
    s.recv(64)
    s.settimeout(None)
    conns.append(s)
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(args) + "\n")
def watch(s):
    if not s.recv(1):
        os._exit(134)
for s in conns:
    threading.Thread(target=watch, args=(s,), daemon=True).start()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b'{"status":"ok"}' if self.path == "/health" else \
            b"llamacpp:requests_processing 0\n"
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"rpc": rpc}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
if host.endswith(".sock"):  # behind md-failover's front, as llama-server listens there
    class Unix(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True
    Unix(host, H).serve_forever()
http.server.ThreadingHTTPServer((host, port), H).serve_forever()
'''


class FakeRpc:
    """Answers HELLO like rpc-server, one client at a time; stop() closes the listener and
    the client it serves (the client sees the worker close its end)."""

    def __init__(self, port: int = 0):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.client = None
        self.running = True
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while self.running:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.client = c
            self._handle(c)

    def _handle(self, c):
        """One client at a time, as rpc-server serves them."""
        self._one(c)

    @staticmethod
    def _one(c):
        """HELLO answered, then the client held until it closes."""
        try:
            data = c.recv(33)
            if data and data[0] == 14:
                c.sendall(struct.pack("<Q", 3) + bytes([3, 0, 0]))
            while c.recv(4096):
                pass
        except OSError:
            pass
        c.close()

    def stop(self):
        self.running = False
        try:  # wakes the accept() of the serving thread, which holds the listener open
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        if self.client is not None:
            try:  # a close() alone sends nothing while another thread is in recv() on it
                self.client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.client.close()


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_for(predicate, timeout=20.0, step=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()


@pytest.fixture
def setup(tmp_path):
    fake = tmp_path / "fake-llama-server.py"
    # The state file's folder also holds llama-server's Unix socket behind the front: a short
    # path (sockaddr_un), not pytest's.
    short = Path(tempfile.mkdtemp(prefix="mdf-"))
    fake.write_text(FAKE)
    log = tmp_path / "argv.log"
    log.touch()
    procs = []

    def start(workers: dict, placements: list, port: int, env: dict | None = None,
              front: bool = False, platform: str | None = None):
        # platform: md-failover run as on another system (sys.platform set before it starts),
        # every file or folder it opens under /proc said on stderr ("read /proc/...")
        run = [sys.executable, str(SCRIPT)] if platform is None else [
            sys.executable, "-c", "import os, runpy, sys; sys.platform = sys.argv.pop(1); "
            "sys.addaudithook(lambda e, a: e in ('open', 'os.listdir', 'os.scandir') and "
            "isinstance(a[0], str) and a[0].startswith('/proc/') and "
            "os.write(2, ('read ' + a[0] + chr(10)).encode())); "
            "sys.argv.pop(0); runpy.run_path(sys.argv[0], run_name='__main__')",
            platform, str(SCRIPT)]
        argv = [*run, "--state", str(short / "state.json"), "--interval", "0.5"]
        if front:
            argv += ["--front", f"127.0.0.1:{port}"]
        for name, rpc in workers.items():
            argv += ["--worker", f"{name}=127.0.0.1:{rpc.port}"]
        for p in placements:
            argv += ["--placement", *p]
        argv += ["--", sys.executable, str(fake), "--host", "127.0.0.1", "--port", str(port)]
        proc = subprocess.Popen(argv, env=dict(os.environ, FAKE_LOG=str(log), **(env or {})),
                                stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    def starts():
        return [json.loads(line) for line in log.read_text().splitlines()]

    yield start, starts, short
    for p in procs:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
    shutil.rmtree(short, ignore_errors=True)


def held(pid: int) -> set[tuple[int, int]]:
    """(local port, remote port) of every TCP connection process `pid` holds a descriptor of."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        w = line.split()
        if w[9] in inodes and w[3] == "01":
            out.add((int(w[1].rsplit(":", 1)[1], 16), int(w[2].rsplit(":", 1)[1], 16)))
    return out


def rpc_of(argv: list) -> str | None:
    return argv[argv.index("--rpc") + 1] if "--rpc" in argv else None


def test_it_switches_to_the_placement_without_a_lost_worker_and_back(setup):
    start, starts, tmp = setup
    a, b = FakeRpc(), FakeRpc()
    both, only_a, only_b = (f"127.0.0.1:{a.port},127.0.0.1:{b.port}", f"127.0.0.1:{a.port}",
                            f"127.0.0.1:{b.port}")
    proc = start({"na": a, "nb": b}, [["-", both, "9,10"], ["nb", only_a, "-"],
                                      ["na", only_b, "-"]], free_port())
    assert wait_for(lambda: len(starts()) == 1), proc.stderr
    assert rpc_of(starts()[0]) == both and starts()[0][-2:] == ["-ts", "9,10"]
    state = json.loads((tmp / "state.json").read_text())
    assert state["state"] == "serving" and state["lost"] == []

    b.stop()  # the worker closes its end: llama-server aborts, md-failover restarts it without nb
    assert wait_for(lambda: len(starts()) == 2)
    assert rpc_of(starts()[1]) == only_a and "-ts" not in starts()[1]
    assert wait_for(lambda: json.loads((tmp / "state.json").read_text())["lost"] == ["nb"])

    b2 = FakeRpc(b.port)  # nb back on its old port
    assert wait_for(lambda: len(starts()) == 3)
    assert rpc_of(starts()[2]) == both
    assert proc.poll() is None
    # md-failover keeps no copy of llama-server's connections open: a copy would keep a
    # connection llama-server closed open, its worker's rpc-server serving a dead client, and
    # the next llama-server waiting behind it for ever.
    child = wait_for(lambda: json.loads((tmp / "state.json").read_text()).get("pid"))
    assert wait_for(lambda: len(held(child)) == 2), held(child)
    assert held(proc.pid) == set()
    a.stop()
    b2.stop()


def test_a_set_without_a_placement_is_down_not_a_restart_loop(setup):
    start, starts, tmp = setup
    a, b = FakeRpc(), FakeRpc()
    b.stop()
    proc = start({"na": a, "nb": b},
                 [["-", f"127.0.0.1:{a.port},127.0.0.1:{b.port}", "-"]], free_port())
    assert wait_for(lambda: (tmp / "state.json").exists()
                    and json.loads((tmp / "state.json").read_text())["state"] == "down")
    time.sleep(1.5)
    assert starts() == [] and proc.poll() is None
    proc.terminate()
    _, err = proc.communicate(timeout=10)
    assert "down while nb is away" in err
    a.stop()


def test_no_probe_connects_to_a_worker_llama_server_is_using(setup):
    """rpc-server serves one client at a time: a probe would wait in the backlog the next
    llama-server needs. While llama-server holds both workers, nothing else connects."""
    start, starts, _ = setup
    accepted = []

    class Counting(FakeRpc):
        """Accepts every connection at once (a thread each), so a probe that connected to a
        worker in use would be counted, not left waiting in the backlog."""

        def _handle(self, c):
            accepted.append(self.port)
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    a, b = Counting(), Counting()
    start({"na": a, "nb": b}, [["-", f"127.0.0.1:{a.port},127.0.0.1:{b.port}", "-"],
                               ["nb", f"127.0.0.1:{a.port}", "-"]], free_port())
    assert wait_for(lambda: len(starts()) == 1)
    before = len(accepted)  # the start's HELLO probes and llama-server's own connections
    time.sleep(3)  # six intervals
    assert len(accepted) == before == 6  # two HELLOs, then llama-server: twice each
    a.stop()
    b.stop()


def test_status_says_which_placement_runs():
    """`meshdeploy status` rows from md-failover's state file (roles/services/failover.py)."""
    from meshdeploy.core.loading import load_cluster
    from meshdeploy.roles.services import failover

    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    probe = failover.status(cluster, cluster.host("node1"), {"main"})
    assert "/run/meshdeploy-server-main/failover.json" in probe.script
    assert failover.status(cluster, cluster.host("node2"), {"main"}) is None
    full = json.dumps({"state": "serving", "lost": [], "since": "2026-11-29T14:02:00Z"})
    less = json.dumps({"state": "serving", "lost": ["node3"], "rpc": "10.200.0.12:50052",
                       "since": "2026-11-29T14:02:00Z"})
    down = json.dumps({"state": "down", "lost": ["node2", "node3"], "since": "x"})
    rows = [probe.parse([f"failover main {text}"])[0] for text in (full, less, down, "{bad")]
    assert [(r.unit, r.answer, r.healthy) for r in rows] == [
        ("serving", "full placement since 2026-11-29T14:02:00Z", True),
        ("serving", "without node3 since 2026-11-29T14:02:00Z (--rpc 10.200.0.12:50052)",
         False),
        ("down", "down while node2, node3 are away (since x): no placement without them",
         False),
        ("unknown", "state file unreadable", False)]
    # A line for another server, or none: the row says so rather than inventing one.
    assert [r.answer for r in probe.parse(["failover other {}"])] == ["no status line"]


def test_a_worker_that_stops_answering_while_llama_server_connects_is_lost(setup):
    """A worker gone while llama-server starts: its connect stays unanswered (SYN_SENT), and
    llama-server would keep loading for minutes. After the user timeout md-failover takes the
    worker for lost and starts the placement without it."""
    start, starts, tmp = setup
    a = FakeRpc()
    b = socket.socket()  # nb: answers md-failover's HELLO, then takes no connection at all
    b.bind(("127.0.0.1", 0))
    b.listen(0)
    port_b = b.getsockname()[1]
    fill = []

    def answer_once_then_fill():
        c, _ = b.accept()
        if c.recv(33)[:1] == bytes([14]):
            c.sendall(struct.pack("<Q", 3) + bytes([3, 0, 0]))
        c.close()
        for _ in range(2):  # the accept queue full: the kernel drops every further SYN
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port_b))
            fill.append(s)

    threading.Thread(target=answer_once_then_fill, daemon=True).start()
    both = f"127.0.0.1:{port_b},127.0.0.1:{a.port}"
    proc = start({"nb": type("W", (), {"port": port_b})(), "na": a},
                 [["-", both, "-"], ["nb", f"127.0.0.1:{a.port}", "-"]], free_port(),
                 env={"FAKE_CONNECT": "120"})
    assert wait_for(lambda: (tmp / "state.json").exists()
                    and json.loads((tmp / "state.json").read_text())["lost"] == ["nb"], 30), \
        proc.stderr
    assert wait_for(lambda: len(starts()) == 1)
    assert rpc_of(starts()[0]) == f"127.0.0.1:{a.port}"
    a.stop()
    b.close()


def _loop(port: int, stop: threading.Event, results: list) -> None:
    """Requests one after the other, as a client keeps sending them: (when sent, outcome)."""
    while not stop.is_set():
        sent = time.monotonic()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/completion", data=b"{}",
                                        timeout=60) as r:
                results.append((sent, r.status))
        except Exception as exc:  # noqa: BLE001 - whatever failed, the test shows it
            results.append((sent, repr(exc)))
        time.sleep(0.05)


@pytest.mark.parametrize("front", [True, False])
def test_requests_wait_at_the_front_while_llama_server_switches_back(setup, front):
    """Without the front, requests sent while llama-server restarts on the full placement are
    refused (its port is closed for the restart and the load); with it, each waits and is
    answered by the new llama-server."""
    start, starts, _ = setup
    a, b = FakeRpc(), FakeRpc()
    port = free_port()
    both, only_a = f"127.0.0.1:{a.port},127.0.0.1:{b.port}", f"127.0.0.1:{a.port}"
    proc = start({"na": a, "nb": b}, [["-", both, "-"], ["nb", only_a, "-"]], port,
                 front=front)
    assert wait_for(lambda: len(starts()) == 1)
    b.stop()
    assert wait_for(lambda: len(starts()) == 2)
    stop, results = threading.Event(), []
    client = threading.Thread(target=_loop, args=(port, stop, results), daemon=True)
    client.start()
    assert wait_for(lambda: any(r == 200 for _, r in results)), results
    back = time.monotonic()
    b2 = FakeRpc(b.port)
    assert wait_for(lambda: len(starts()) == 3)
    assert rpc_of(starts()[2]) == both
    served = len(results)
    assert wait_for(lambda: len(results) > served + 5)
    stop.set()
    client.join(70)
    during = [r for t, r in results if t >= back]
    failed = [r for r in during if r != 200]
    if front:
        assert failed == [] and len(during) > 5, during
    else:
        assert failed, during  # what the front is for: refused while it restarts
    a.stop()
    b2.stop()


def test_a_health_probe_is_answered_at_once_while_no_placement_runs(setup):
    """While no llama-server can run, the front says so to /health at once (503, as
    llama-server says while it loads) and to any other request after it was read."""
    start, _, tmp = setup
    a, b = FakeRpc(), FakeRpc()
    b.stop()
    port = free_port()
    start({"na": a, "nb": b}, [["-", f"127.0.0.1:{a.port},127.0.0.1:{b.port}", "-"]], port,
          front=True)
    assert wait_for(lambda: (tmp / "state.json").exists()
                    and json.loads((tmp / "state.json").read_text())["state"] == "down")
    for path, data in (("/health", None), ("/completion", b"{}")):
        began = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", data=data, timeout=10)
        assert err.value.code == 503
        assert json.loads(err.value.read())["error"]["message"] == "down while nb is away"
        assert time.monotonic() - began < 2
    a.stop()


def _module():
    spec = importlib.util.spec_from_file_location("md_failover", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Rows of /proc/net/tcp read in a network namespace (Linux 6.1) while a peer's namespace dropped
# everything both ways (nftables, no RST): llama-server's connections as md-failover arms them
# (keepalive 2 s idle, 1 s probes, 2 probes, 4 s user timeout).
ROW_IDLE_OK = ("0: 0100FB0A:8ADA 0200FB0A:C384 01 00000000:00000000 02:00000096 00000000     0"
               "        0 6185260 3 00000000090f1fef 20 0 0 10 -1")
ROW_IDLE_ONE_PROBE = ("0: 0100FB0A:8ADA 0200FB0A:C384 01 00000000:00000000 02:00000045 00000000"
                      "     0        1 6185260 2 00000000090f1fef 20 0 0 10 -1")  # 1.8 s after
ROW_IDLE_PROBING = ("0: 0100FB0A:8ADA 0200FB0A:C384 01 00000000:00000000 02:00000050 00000000"
                    "     0        2 6185260 2 00000000090f1fef 20 0 0 10 -1")  # 2.7 s after
ROW_SENDING_RETRANSMITTING = ("1: 0100FB0A:8ADC 0200FB0A:C384 01 000003E8:00000000 01:0000004A"
                              " 00000002     0        0 6185261 3 00000000719a0449 81 0 0 1 -1")


def test_a_row_with_unanswered_retransmissions_or_probes_is_failing():
    md = _module()
    assert not md._failing(ROW_IDLE_OK.split())
    # One probe awaiting its answer is a round trip's normal state on a live link too.
    assert not md._failing(ROW_IDLE_ONE_PROBE.split())
    assert md._failing(ROW_IDLE_PROBING.split())
    assert md._failing(ROW_SENDING_RETRANSMITTING.split())
    assert not md._failing(["0:", "x"])


def test_what_was_read_of_a_failing_link_survives_llama_servers_exit():
    """llama-server aborts the moment the user timeout ends its connection, and the next read
    of the kernel's table finds it exited but not yet reaped: its /proc/PID/fd lists nothing.
    That read emptied the failing set (and took every connection for closed by llama-server
    itself), so the exit's handling never saw the failing link (found by review: the first
    version of this never applied)."""
    md = _module()
    opts = argparse.Namespace(worker=["nd=127.0.0.1:9"], placement=[], argv=["llama-server"],
                              state=None, settle=2)
    sup = md.Supervisor(opts)
    sup.watching = True
    sup.child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and \
            not Path(f"/proc/{sup.child.pid}/stat").read_text().split(") ")[1].startswith("Z"):
        time.sleep(0.05)  # a zombie: exited, not reaped (nothing here waits for it)
    sup.armed, sup.failing = {"999999999": "nd"}, {"nd"}
    assert sup.hung_up(0) == set()
    assert sup.failing == {"nd"} and sup.armed == {"999999999": "nd"}
    assert sup.child.poll() == 0  # its exit is still there for serve() to see


def test_after_llama_server_aborts_a_timed_out_connect_is_final_only_for_a_failing_link():
    """After llama-server exits, the workers it dialed are asked HELLO up to three times: one
    may still be finishing its last graph, its backlog full of queued probes (every SYN then
    times out). A worker whose connection from llama-server was failing at the last read of the
    kernel's table (retransmissions or keepalive probes unanswered) and whose connect times out
    is not asked again: its link is down. Before, the three tries kept the server down about
    4 s longer after every silent loss (the 2 GB model in benchmarks/failover.py: switch 9.6 s
    after the cut, llama-server's abort at 5.7 s). Real sockets on loopback: an accept queue
    kept full drops every SYN, as a dropped link does."""
    md = _module()
    answering = FakeRpc()
    silent = socket.socket()  # accepts (the kernel completes the handshake), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)

    def full():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        return s, socket.create_connection(s.getsockname(), timeout=1)

    down, down_queued = full()  # the failing link
    busy, busy_queued = full()  # a live worker that frees its backlog after 1.2 s

    def serve_later():
        time.sleep(1.2)
        busy_queued.close()
        while True:
            try:
                c, _ = busy.accept()
            except OSError:
                return
            FakeRpc._one(c)

    threading.Thread(target=serve_later, daemon=True).start()
    targets = {"na": f"127.0.0.1:{answering.port}",
               "ns": f"127.0.0.1:{silent.getsockname()[1]}",
               "nd": f"127.0.0.1:{down.getsockname()[1]}",
               "nb": f"127.0.0.1:{busy.getsockname()[1]}"}
    asked = []
    real = md.hello

    def counting(target, deadline=md.HELLO_TIMEOUT):
        asked.append(target)
        return real(target, deadline)

    md.hello = counting
    opts = argparse.Namespace(worker=[f"{n}={t}" for n, t in targets.items()], placement=[],
                              argv=["llama-server"], state=None, settle=2)
    sup = md.Supervisor(opts)
    got = sup.answering(list(targets), tries=md.HELLO_TRIES, failing={"nd"})
    assert got == {"na", "nb"}, (got, asked)
    assert [asked.count(targets[n]) for n in ("na", "ns", "nd")] == [1, md.HELLO_TRIES, 1]
    md.hello = real
    assert [md.hello(targets[n]) for n in ("na", "ns", "nd")] == [
        md.ANSWERED, md.NO_ANSWER, md.UNREACHABLE]
    for s in (silent, down, down_queued, busy):
        s.close()
    answering.stop()


def test_without_the_kernels_table_a_lost_worker_is_seen_when_llama_server_exits(setup):
    """macOS (launchd) has no pidfd_getfd and no /proc: md-failover watches nothing there and
    learns of a lost worker from llama-server's exit (it aborts on the worker's closed end).
    No Mac here: md-failover run with sys.platform "darwin" on Linux, which takes the same
    path, shows it switches and comes back without reading /proc (an audit hook says what it
    opens there)."""
    start, starts, tmp = setup
    a, b = FakeRpc(), FakeRpc()
    both, only_a = f"127.0.0.1:{a.port},127.0.0.1:{b.port}", f"127.0.0.1:{a.port}"
    proc = start({"na": a, "nb": b}, [["-", both, "-"], ["nb", only_a, "-"]], free_port(),
                 platform="darwin")
    assert wait_for(lambda: len(starts()) == 1), proc.stderr
    child = wait_for(lambda: json.loads((tmp / "state.json").read_text()).get("pid"))
    b.stop()
    assert wait_for(lambda: len(starts()) == 2)
    assert rpc_of(starts()[1]) == only_a
    assert wait_for(lambda: json.loads((tmp / "state.json").read_text())["lost"] == ["nb"])
    b2 = FakeRpc(b.port)
    assert wait_for(lambda: len(starts()) == 3)
    assert rpc_of(starts()[2]) == both and proc.poll() is None
    proc.terminate()
    _, err = proc.communicate(timeout=20)
    # It says at its start that it watches nothing (it said nothing before: the docs promised
    # it), and learned of the loss from the exit.
    assert "cannot watch llama-server's connections (darwin has no pidfd_getfd" in err, err
    assert "llama-server exited with status" in err and child, err
    assert "read /proc/" not in err, err  # on Linux: /proc/PID/fd, /proc/net/tcp every second
    a.stop()
    b2.stop()
