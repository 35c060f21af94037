"""md-share (meshdeploy/core/templates/md-share.py): the real script as a subprocess, on loopback
only."""

from __future__ import annotations

import http.client
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "meshdeploy" / "core" / "templates" / "md-share.py"
SIZE = 3 * 1024 * 1024


def free_port(bind: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET) as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


class Share:
    def __init__(self, tmp: Path, *extra: str, idle: float = 30, max_: float = 60,
                 port: int | None = None, name: str = "a", bind: str = "127.0.0.1"):
        self.bind, self.port = bind, port or free_port(bind)
        self.pid_file, self.log = tmp / f"{name}.pid", tmp / f"{name}.log"
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--bind", bind, "--port", str(self.port),
             "--file", f"blob={tmp / 'blob'}", "--idle", str(idle), "--max", str(max_),
             "--pid-file", str(self.pid_file), "--log", str(self.log), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_listening(self) -> "Share":
        deadline = time.monotonic() + 10
        while not self.pid_file.exists():
            assert self.proc.poll() is None, self.proc.communicate()
            assert time.monotonic() < deadline, "no pid file"
            time.sleep(0.02)
        assert self.pid_file.read_text() == f"{self.proc.pid}\n"
        return self

    def request(self, method: str = "GET", path: str = "/models/blob", **headers: str):
        conn = http.client.HTTPConnection(self.bind, self.port, timeout=10)
        conn.request(method, path, headers=headers)
        r = conn.getresponse()
        body = r.read()
        conn.close()
        return r, body

    def lines(self, at_least: int = 0) -> list[list[str]]:
        """The log split in words; a request's line is written just after its reply went out."""
        deadline = time.monotonic() + 5
        while True:
            lines = [line.split() for line in self.log.read_text().splitlines()]
            if len(lines) >= at_least or time.monotonic() > deadline:
                return lines
            time.sleep(0.02)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(10)


@pytest.fixture
def blob(tmp_path) -> bytes:
    data = os.urandom(SIZE)
    (tmp_path / "blob").write_bytes(data)
    return data


@pytest.fixture
def share(tmp_path, blob):
    s = Share(tmp_path, "--allow", "127.0.0.1").wait_listening()
    yield s
    s.stop()


def test_ranges_whole_file_and_head(share, blob, tmp_path):
    first, last = 1_000_003, 2_500_000
    out = tmp_path / "out"
    code = subprocess.run(
        ["curl", "-s", "-r", f"{first}-{last}", "-o", str(out), "-w", "%{http_code}",
         f"http://127.0.0.1:{share.port}/models/blob"],
        capture_output=True, text=True, timeout=10).stdout
    assert code == "206" and out.read_bytes() == blob[first:last + 1]

    r, body = share.request(Range=f"bytes={first}-{last}")
    assert r.status == 206 and body == blob[first:last + 1]
    assert r.headers["Content-Range"] == f"bytes {first}-{last}/{SIZE}"
    assert r.headers["Content-Length"] == str(last - first + 1)
    assert r.headers["Content-Type"] == "application/octet-stream"

    r, body = share.request(Range="bytes=3000000-")
    assert r.status == 206 and body == blob[3000000:]
    assert r.headers["Content-Range"] == f"bytes 3000000-{SIZE - 1}/{SIZE}"

    r, body = share.request(Range="bytes=-4096")
    assert r.status == 206 and body == blob[-4096:]
    assert r.headers["Content-Range"] == f"bytes {SIZE - 4096}-{SIZE - 1}/{SIZE}"

    r, body = share.request(Range=f"bytes=10-{SIZE * 2}")  # an end past the file is clipped
    assert r.status == 206 and body == blob[10:]

    r, body = share.request()
    assert r.status == 200 and body == blob and r.headers["Accept-Ranges"] == "bytes"

    r, body = share.request("HEAD")
    assert r.status == 200 and r.headers["Content-Length"] == str(SIZE) and body == b""


def test_not_found_bad_range_and_method(share):
    for path in ("/models/other", "/models/", "/models/blob/", "/blob", "/models/blob?x=1"):
        r, body = share.request(path=path)
        assert r.status == 404 and body == b"", path
    for bad in (f"bytes={SIZE}-", "bytes=5-2", "bytes=0-1,5-6", "bytes=-0", "bytes=-",
                "bytes=a-b", "items=0-1", ""):
        r, body = share.request(Range=bad)
        assert r.status == 416 and r.headers["Content-Range"] == f"bytes */{SIZE}", bad
    conn = http.client.HTTPConnection("127.0.0.1", share.port, timeout=10)
    conn.putrequest("GET", "/models/blob")
    conn.putheader("Range", "bytes=0-1")
    conn.putheader("Range", "bytes=2-3")
    conn.endheaders()
    r = conn.getresponse()
    assert r.status == 416 and r.read() == b""  # two Range headers are two ranges
    conn.close()
    for method in ("POST", "PUT", "DELETE", "OPTIONS"):
        r, _ = share.request(method)
        assert r.status == 405, method
    lines = share.lines(at_least=1 + 5 + 9 + 4)
    # each line goes out just after its reply, so two connections' lines may swap places
    assert sorted(w[4] for w in lines[1:]) == ["404"] * 5 + ["405"] * 4 + ["416"] * 9


def test_keep_alive(share, blob):
    conn = http.client.HTTPConnection("127.0.0.1", share.port, timeout=10)
    conn.request("GET", "/models/blob", headers={"Range": "bytes=0-99"})
    r = conn.getresponse()
    assert r.status == 206 and r.read() == blob[:100]
    sock = conn.sock
    conn.request("GET", "/models/nope")
    r = conn.getresponse()
    assert r.status == 404 and r.read() == b""
    conn.request("GET", "/models/blob", headers={"Range": "bytes=100-199"})
    r = conn.getresponse()
    assert r.status == 206 and r.read() == blob[100:200]
    assert conn.sock is sock  # the same connection carried all three
    conn.close()


def test_log_line_and_no_header_values(share):
    r, _ = share.request(Range="bytes=6527680-", **{"X-Token": "hunter2"})
    assert r.status == 416  # past the 3 MiB file
    r, _ = share.request(Range="bytes=1000-2999999", **{"Authorization": "Bearer hunter2"})
    assert r.status == 206
    lines = share.lines(at_least=3)
    assert lines[0][1:] == ["listening", "127.0.0.1", str(share.port)]
    t, ip, method, path, status, first, sent = next(w for w in lines if w[4:5] == ["206"])
    assert abs(float(t) - time.time()) < 10 and len(t.split(".")[1]) == 3
    assert (ip, method, path, status, first, sent) == (
        "127.0.0.1", "GET", "/models/blob", "206", "1000", "2999000")
    assert next(w for w in lines if w[4:5] == ["416"])[5:] == ["-", "0"]
    assert "hunter2" not in share.log.read_text()


def test_allow_list(tmp_path, blob):
    allowed = Share(tmp_path, "--no-loopback", "--allow", "127.0.0.1", name="yes")
    refused = Share(tmp_path, "--no-loopback", "--allow", "10.255.255.1", name="no")
    try:
        allowed.wait_listening()
        refused.wait_listening()
        r, body = allowed.request(Range="bytes=0-9")
        assert r.status == 206 and body == blob[:10]
        for method in ("GET", "POST"):  # closed as accepted, before anything is read
            with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
                refused.request(method, Range="bytes=0-9")
        assert [w[1:] for w in refused.lines(at_least=3)[1:]] == [["127.0.0.1", "refused"]] * 2
    finally:
        assert allowed.stop() == 0 and refused.stop() == 0


def trickle(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection whose request line is whole and whose headers never end."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    s.sendall(b"GET /models/blob HTTP/1.1\r\nHost: x\r\n")
    return s


def drip(conns, seconds: float, until=lambda: False) -> None:
    """A header byte on each connection every 0.2 s: each read the server waits on succeeds."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        for c in conns:
            try:
                c.send(b"X")
            except OSError:
                pass  # closed by the server
        time.sleep(0.2)


def test_a_refused_client_that_trickles_does_not_keep_md_share_up(tmp_path, blob):
    # Before: a refused peer was counted in flight from its request line until its headers
    # ended (120 s a read), so --idle 1 never came while it trickled.
    s = Share(tmp_path, "--no-loopback", "--allow", "10.255.255.1", idle=1).wait_listening()
    conn = trickle(s.port)
    drip([conn], 8, until=lambda: s.proc.poll() is not None)
    assert s.proc.wait(1) == 0 and time.monotonic() - s.started < 4
    assert s.lines()[-1][1:] == ["exit", "idle"]
    conn.close()


def test_an_allowed_request_still_arriving_is_not_in_flight(tmp_path, blob):
    # Within --head-timeout (10 s), yet only a whole request counts against --idle.
    s = Share(tmp_path, "--allow", "127.0.0.1", idle=1).wait_listening()
    conn = trickle(s.port)
    drip([conn], 8, until=lambda: s.proc.poll() is not None)
    assert s.proc.wait(1) == 0 and time.monotonic() - s.started < 4
    conn.close()


def threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_many_refused_connections_take_no_thread_and_starve_no_one(tmp_path, blob):
    # 127.0.0.2 is loopback too, but --no-loopback and the list leave only 127.0.0.1.
    s = Share(tmp_path, "--no-loopback", "--allow", "127.0.0.1").wait_listening()
    try:
        conns = [trickle(s.port, "127.0.0.2") for _ in range(100)]
        drip(conns, 1)
        assert threads(s.proc.pid) < 8  # before: one thread each, 120 s a read
        started = time.monotonic()
        r, body = s.request(Range="bytes=0-9")
        assert r.status == 206 and body == blob[:10] and time.monotonic() - started < 2
        assert sum(w[1:] == ["127.0.0.2", "refused"] for w in s.lines(at_least=102)) == 100
        for c in conns:
            c.close()
    finally:
        assert s.stop() == 0


def test_connections_past_the_cap_get_503_and_a_slow_head_is_dropped(tmp_path, blob):
    s = Share(tmp_path, "--allow", "127.0.0.1", "--max-connections", "3",
              "--head-timeout", "1.5").wait_listening()
    try:
        slow = [trickle(s.port) for _ in range(3)]
        time.sleep(0.3)
        extra = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        reply = extra.recv(4096)  # answered at once, before it sent anything
        assert reply.startswith(b"HTTP/1.1 503 ") and b"Content-Length: 0" in reply
        extra.close()
        drip(slow, 3)  # each read succeeds, yet the head as a whole is late: dropped
        for c in slow:
            c.settimeout(2)
            try:
                assert c.recv(4096) == b""  # closed, unanswered
            except ConnectionResetError:
                pass  # closed with our header bytes unread
            c.close()
        r, body = s.request(Range="bytes=5-9")  # the slots are free again
        assert r.status == 206 and body == blob[5:10]
    finally:
        assert s.stop() == 0
    assert "Traceback" not in s.proc.stderr.read()


def test_a_range_with_thousands_of_digits_is_refused(share, blob):
    # Before: int() of more than 4300 digits raised in the handler, which closed the connection
    # without a reply and wrote a traceback.
    for bad in ("bytes=0-" + "9" * 5000, "bytes=" + "1" * 4400 + "-", "bytes=-" + "7" * 4301,
                "bytes=0-" + "0" * 20 + "9"):
        r, body = share.request(Range=bad)
        assert r.status == 416 and r.headers["Content-Range"] == f"bytes */{SIZE}", bad[:20]
    r, body = share.request(Range="bytes=0-" + "0" * 18 + "9")
    assert r.status == 206 and body == blob[:10]
    share.stop()
    assert "Traceback" not in share.proc.stderr.read()


def test_served_files_are_never_read_through_a_symlink(tmp_path, blob):
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a model " * 100)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "blob")
    refused = subprocess.run(
        [sys.executable, str(SCRIPT), "--bind", "127.0.0.1", "--port", str(free_port()),
         "--allow", "127.0.0.1", "--file", f"blob={link}", "--idle", "5", "--max", "5",
         "--pid-file", str(tmp_path / "x.pid")], capture_output=True, text=True, timeout=10)
    assert refused.returncode == 2 and "symbolic link" in refused.stderr, refused.stderr

    s = Share(tmp_path, "--allow", "127.0.0.1").wait_listening()
    try:
        (tmp_path / "blob").rename(tmp_path / "blob.old")  # the path now names the secret
        (tmp_path / "blob").symlink_to(secret)
        r, body = s.request(Range="bytes=0-99")
        assert r.status == 500 and body == b""  # neither the secret nor the file it replaced
    finally:
        assert s.stop() == 0


def test_a_file_replaced_at_its_path_is_served_as_it_is_now(tmp_path, blob):
    """A build's tarball packed again is renamed over the old one: an md-share started before
    serves the new file, as it serves a file changed in place, and nothing while none is there."""
    s = Share(tmp_path, "--allow", "127.0.0.1").wait_listening()
    try:
        assert s.request(Range="bytes=0-9")[1] == blob[:10]
        packed = tmp_path / "blob.tmp"
        packed.write_bytes(b"packed again" * 100)
        packed.rename(tmp_path / "blob")
        r, body = s.request()
        assert r.status == 200 and body == b"packed again" * 100
        with open(tmp_path / "blob", "r+b") as f:  # changed in place: the same file
            f.write(b"P")
        assert s.request(Range="bytes=0-5")[1] == b"Packed"
        (tmp_path / "blob").unlink()
        assert s.request()[0].status == 503
    finally:
        assert s.stop() == 0


def test_a_growing_partial_that_is_a_symlink_is_not_followed(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 5000)
    partial = tmp_path / "blob.partial"
    partial.symlink_to(secret)
    s = Share(tmp_path, "--allow", "127.0.0.1", "--growing", f"blob={partial}:5000",
              "--wait", "1").wait_listening()
    try:
        r, body = s.request(Range="bytes=0-9")
        assert r.status == 500 and body == b""
    finally:
        assert s.stop() == 0


def test_idle_exit_waits_for_a_transfer_in_flight(tmp_path, blob):
    big = tmp_path / "blob"  # sparse 256 MiB: more than loopback socket buffers hold
    with open(big, "r+b") as f:
        f.truncate(256 * 1024 * 1024)
    s = Share(tmp_path, "--allow", "127.0.0.1", idle=1).wait_listening()
    kept = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    kept.request("HEAD", "/models/blob")
    assert kept.getresponse().status == 200  # and the connection stays open through the exit
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", s.port))
    stalled.sendall(b"GET /models/blob HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(2)  # the client reads nothing: sendfile blocks, and that counts as busy
    assert s.proc.poll() is None
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
    stalled.close()  # reset mid-body
    closed = time.monotonic()
    assert s.proc.wait(5) == 0
    assert 0.8 < time.monotonic() - closed < 3
    assert not s.pid_file.exists()
    _, ip, method, _, status, first, sent = s.lines()[-2]
    assert (ip, method, status, first) == ("127.0.0.1", "GET", "200", "0")
    assert 0 < int(sent) < 256 * 1024 * 1024
    assert s.lines()[-1][1:] == ["exit", "idle"]
    assert "Traceback" not in s.proc.stderr.read()
    kept.close()


def test_max_exit_despite_requests(tmp_path, blob):
    s = Share(tmp_path, "--allow", "127.0.0.1", idle=30, max_=2).wait_listening()
    answered = 0
    while s.proc.poll() is None and time.monotonic() - s.started < 6:
        try:
            answered += s.request(Range="bytes=0-9")[0].status == 206
        except OSError:
            pass
        time.sleep(0.5)
    assert s.proc.wait(1) == 0
    assert 1.8 < time.monotonic() - s.started < 4.5 and answered >= 2
    assert s.lines()[-1][1:] == ["exit", "max"]
    assert not s.pid_file.exists()


def test_sigterm_and_a_pid_file_taken_over(tmp_path, blob):
    s = Share(tmp_path, "--allow", "127.0.0.1").wait_listening()
    assert s.stop() == 0
    assert s.lines()[-1][1:] == ["exit", "SIGTERM"] and not s.pid_file.exists()

    s = Share(tmp_path, "--allow", "127.0.0.1").wait_listening()
    s.pid_file.write_text("12345\n")  # a later starter's: not ours to remove
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(10) == 0
    assert s.pid_file.read_text() == "12345\n"
    assert s.lines()[-1][1:] == ["exit", "SIGINT"]


def test_port_in_use(share, tmp_path):
    second = Share(tmp_path, "--allow", "127.0.0.1", port=share.port, name="b")
    _, err = second.proc.communicate(timeout=10)
    assert second.proc.returncode == 1
    assert len(err.splitlines()) == 1 and str(share.port) in err and "Traceback" not in err
    assert not second.pid_file.exists()
    assert share.request(Range="bytes=0-0")[0].status == 206  # the first one is untouched


def test_ipv6_loopback(tmp_path, blob):
    try:
        free_port("::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    s = Share(tmp_path, "--no-loopback", "--allow", "::1", bind="::1").wait_listening()
    try:
        r, body = s.request(Range="bytes=5-9")
        assert r.status == 206 and body == blob[5:10]
        assert s.lines(at_least=2)[0][1:] == ["listening", "::1", str(s.port)]
        assert s.lines()[1][1:5] == ["::1", "GET", "/models/blob", "206"]
    finally:
        assert s.stop() == 0


def test_helpers():
    spec = importlib.util.spec_from_file_location("md_share", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # main() runs only as a script
    assert str(mod.plain_ip("::ffff:10.0.0.7")) == "10.0.0.7"  # dual-stack view of IPv4
    assert mod.plain_ip("::ffff:10.0.0.7") in {mod.plain_ip("10.0.0.7")}
    assert str(mod.plain_ip("fd00::7")) == "fd00::7" and mod.plain_ip("host") is None
    assert mod.parse_range("bytes=0-0", 10) == (0, 0)
    assert mod.parse_range("bytes=-20", 10) == (0, 9)
    assert mod.parse_range("bytes=-1", 0) is None and mod.parse_range("bytes=0-", 0) is None
    assert mod.parse_range("bytes=0-\u0661", 10) is None  # Unicode digits are not digits here
    assert mod.parse_range("bytes=0-" + "9" * 5000, 10) is None  # not int()'s ValueError


def test_a_growing_file_is_served_as_it_arrives_then_whole(tmp_path):
    """--growing: while the whole file is absent, a reply trails its partial as it grows (a
    host copying a model while the source still downloads it); once renamed, the file."""
    data = os.urandom(3 * 1024 * 1024 + 11)
    partial = tmp_path / "blob.partial"
    partial.write_bytes(data[:100_000])
    share = Share(tmp_path, "--allow", "127.0.0.1", "--growing", f"blob={partial}:{len(data)}",
                  "--wait", "5")
    share.wait_listening()

    def grow():
        with open(partial, "ab") as f:
            for i in range(100_000, len(data), 512 * 1024):
                time.sleep(0.1)
                f.write(data[i:i + 512 * 1024])
                f.flush()
    writer = threading.Thread(target=grow)
    writer.start()
    started = time.monotonic()
    r, body = share.request()
    writer.join()
    assert r.status == 200 and body == data
    assert time.monotonic() - started >= 0.5  # it waited for the bytes, it did not cut short
    partial.rename(tmp_path / "blob")
    r, body = share.request(Range="bytes=10-19")
    assert r.status == 206 and body == data[10:20]
    share.stop()


def test_a_growing_file_that_stalls_is_cut_short(tmp_path):
    partial = tmp_path / "blob.partial"
    partial.write_bytes(b"x" * 1000)
    share = Share(tmp_path, "--allow", "127.0.0.1", "--growing", f"blob={partial}:5000",
                  "--wait", "1")
    share.wait_listening()
    conn = http.client.HTTPConnection("127.0.0.1", share.port, timeout=10)
    conn.request("GET", "/models/blob")
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Length") == "5000"
    with pytest.raises(http.client.IncompleteRead) as info:
        r.read()
    assert len(info.value.partial) == 1000  # never more than arrived, never made up
    conn.close()
    words = share.lines(at_least=1)[-1]
    assert words[4:] == ["200", "0", "1000"], words
    share.stop()


def test_a_method_with_controls_is_logged_inert(share):
    """The log is shown to the operator when md-share fails to start: a request line's method
    (any token a client sends) is logged with controls replaced, like its path."""
    with socket.create_connection(("127.0.0.1", share.port), timeout=5) as s:
        s.sendall(b"G\x1b]0;owned\x07T /models/blob\x9b HTTP/1.1\r\nHost: x\r\n\r\n")
        s.recv(4096)
    lines = share.lines(at_least=2)
    text = share.log.read_text()
    assert len(lines) >= 2 and "\x1b" not in text and "\x07" not in text and "\x9b" not in text
    assert any(w[2:3] == ["G?]0;owned?T"] for w in lines), lines
