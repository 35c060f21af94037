#!/usr/bin/env python3
"""md-share: serve byte ranges of verified GGUF files to the cluster's other hosts.

During an apply, a worker that lacks a model fetches only the tensors it holds, as byte ranges
of a copy another host has already verified, instead of downloading the whole model from the
internet. meshdeploy starts this on that host and it must not outlive the apply, so it is shaped
to be safe to leave running by mistake:

- short-lived: it exits by itself after --idle seconds with no request in flight, or --max
  seconds after start, or on SIGTERM/SIGINT; the pid file (written atomically once listening)
  tells the starter it is up, and is removed on exit;
- unprivileged: the starter runs it as a DynamicUser systemd unit, or as nobody (core/share.py);
- one purpose: GET/HEAD of /models/<NAME> for the files named on the command line, nothing else,
  each read through a descriptor opened without following a symlink there (one is refused),
  kept while the path names that file and opened again once another file took its place: what
  it serves is the file on disk now, never one a later file replaced (a build's tarball packed
  again is renamed over the old one, and an md-share started earlier would serve the old
  bytes until it exits);
- range-only semantics kept strict (one range per request) so a fetch can never be misread;
- allow-list: the firewall restricts the port, and this is the second fence. A peer it refuses
  is closed as it is accepted, before a thread or a byte read; the others share
  --max-connections slots, and a request head must arrive whole within --head-timeout, so no
  client, refused or slow, can hold md-share up past --idle or crowd the hosts it serves out;
- zero-copy: bodies go out with sendfile, so serving a multi-GiB model costs little CPU;
- pipelined: a file still being downloaded (--growing) is served from its partial as its bytes
  arrive, so a host copying the model trails the download instead of waiting for its end. The
  copy is verified whole (sha256) by the host that receives it, before anything uses it.

Python 3.9+, standard library only: it runs on hosts where meshdeploy is not installed.
"""

import argparse
import errno
import io
import ipaddress
import os
import re
import signal
import socket
import socketserver
import stat
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# At most 19 digits a bound (more than any file has bytes): int() of a long run of digits is
# slow, and past 4300 digits it raises instead of answering.
RANGE = re.compile(r"bytes=([0-9]{0,19})-([0-9]{0,19})")
# Past --max-connections: answered before anything is read, so it costs no thread.
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
        b"Connection: close\r\n\r\n")


def parse_range(value, size):
    """(first, last) of one satisfiable byte range, or None (416) for anything else."""
    m = RANGE.fullmatch(value.strip())  # a comma (several ranges) never matches
    if not m or m.groups() == ("", ""):
        return None
    a, b = m.groups()
    if a == "":  # bytes=-n: the last n bytes
        n = int(b)
        return (max(0, size - n), size - 1) if n and size else None
    first, last = int(a), int(b) if b else size - 1
    if first > last or first >= size:
        return None
    return first, min(last, size - 1)


def plain_ip(text):
    """An ip_address, IPv4-mapped IPv6 (a dual-stack socket's view of IPv4) as IPv4; or None."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    return (ip.ipv4_mapped or ip) if ip.version == 6 else ip


def open_regular(path):
    """A descriptor of the regular file at `path`, never through a symlink there (O_NOFOLLOW):
    md-share serves the file the starter named, not whatever a link points to. O_NONBLOCK: a
    FIFO put there cannot hang the open. FileNotFoundError when absent, OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


class Reader:
    """One reply's view of a descriptor that replies share: socket.sendfile sends from explicit
    offsets and records where it stopped with seek(), here, never in the shared descriptor."""

    def __init__(self, fd, pos=0):
        self.fd, self.pos = fd, pos

    def fileno(self):
        return self.fd

    def seek(self, pos, whence=0):
        self.pos = pos
        return pos

    def tell(self):
        return self.pos

    def read(self, n):  # sendfile's fallback where the platform lacks it
        data = os.pread(self.fd, n, self.pos)
        self.pos += len(data)
        return data


class HeadClock(socket.SocketIO):
    """A connection's reads. A request head (its line and headers) must arrive whole before
    `deadline`: a per-read timeout alone lets a client that trickles a byte at a time hold its
    slot (and, counted in flight, md-share itself) for as long as it likes."""
    deadline = None

    def readinto(self, b):
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("request head too slow")
            self._sock.settimeout(left)
        return super().readinto(b)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every reply carries Content-Length
    timeout = 120  # while a body goes out: drop clients that stop reading

    def setup(self):
        super().setup()
        self.clock = HeadClock(self.connection, "rb")
        self.rfile = io.BufferedReader(self.clock)

    def handle_one_request(self):
        self.status, self.first, self.sent, self.busy = None, "-", 0, False
        # Waiting on a kept-alive connection counts too: an idle one gives its slot back.
        self.clock.deadline = time.monotonic() + self.server.head_timeout
        try:
            super().handle_one_request()
        finally:
            if self.busy:
                self.server.track(-1)
            if self.status is not None:  # None: the client closed without asking anything
                ip = plain_ip(self.client_address[0]) or "-"
                path, method = (
                    "".join(c if c.isprintable() and c != " " else "?" for c in text)[:300]
                    for text in (getattr(self, "path", "-"), self.command or "-"))  # one line
                self.server.log(f"{ip} {method} {path} "
                                f"{self.status} {self.first} {self.sent}")

    def log_request(self, code="-", size="-"):
        self.status = int(code)  # our own line is written once the body is out

    def log_message(self, *args):
        pass  # the default writes to stderr, and some of its messages quote headers

    def version_string(self):
        return "md-share"

    def parse_request(self):
        if not super().parse_request():  # the headers are read here
            return False
        # In flight from here on, not while the head still arrives: only a whole request of an
        # allowed peer (Server.verify_request) keeps md-share from its --idle exit.
        self.clock.deadline = None
        self.connection.settimeout(self.timeout)
        self.server.track(+1)
        self.busy = True
        if self.command not in ("GET", "HEAD"):
            self.reply(405, {"Allow": "GET, HEAD"}, close=True)  # its body is left unread
            return False
        return True

    def reply(self, status, headers=None, length=0, close=False):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        if close:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()

    def do_HEAD(self):
        self.do_GET(body=False)

    def open_file(self, name):
        """(fd, size, own): the whole file's kept descriptor, or, while it is still arriving
        (--growing), its partial opened for this reply alone (own: close it after) and the size
        it will have; None when neither appears within --wait seconds."""
        growing = self.server.growing.get(name)
        deadline = time.monotonic() + self.server.wait
        while True:
            fd = self.server.whole(name)
            if fd is not None:
                return fd, os.fstat(fd).st_size, False
            if growing is not None:
                try:  # a partial may be removed and begun again: never kept
                    return open_regular(growing[0]), growing[1], True
                except FileNotFoundError:
                    pass  # renamed since the look above: the next round finds the whole file
            if growing is None or time.monotonic() > deadline:
                return None
            time.sleep(0.2)

    def send_growing(self, f, first, count):
        """sendfile what has arrived of [first, first+count), waiting for the rest; stops
        (short) when the file has not grown for --wait seconds. Returns the bytes sent."""
        sent, grew = 0, time.monotonic()
        while sent < count:
            have = os.fstat(f.fileno()).st_size - (first + sent)
            if have <= 0:
                if time.monotonic() - grew > self.server.wait:
                    break
                time.sleep(0.1)
                continue
            sent += self.connection.sendfile(f, first + sent, min(have, count - sent))
            grew = time.monotonic()
        return sent

    def do_GET(self, body=True):
        name = self.path[len("/models/"):] if self.path.startswith("/models/") else None
        if name not in self.server.files:
            return self.reply(404)
        try:
            opened = self.open_file(name)
        except OSError:
            return self.reply(500)
        if opened is None:
            return self.reply(503, close=True)
        fd, size, own = opened
        try:
            self.send_body(Reader(fd), size, body)
        finally:
            if own:
                os.close(fd)

    def send_body(self, f, size, body):
        """The reply from `f` (a Reader), one range or the whole file."""
        ranges = self.headers.get_all("Range") or []
        span = parse_range(ranges[0], size) if len(ranges) == 1 else (0, size - 1)
        if span is None or len(ranges) > 1:
            return self.reply(416, {"Content-Range": f"bytes */{size}"})
        first, count = span[0], span[1] - span[0] + 1
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if ranges:
            headers["Content-Range"] = f"bytes {first}-{span[1]}/{size}"
        self.reply(206 if ranges else 200, headers, count)
        if not body or count == 0:
            return
        self.first = first
        f.seek(first)  # sendfile leaves the position after what went out, even on error
        try:
            if size > os.fstat(f.fileno()).st_size:
                self.sent = self.send_growing(f, first, count)
            else:
                self.connection.sendfile(f, first, count)
                self.sent = f.tell() - first
        except OSError:  # the client went away or stopped reading: the byte count says so
            self.sent = f.tell() - first
        if self.sent != count:  # cut short (or the file shrank): this connection is done
            self.close_connection = True


class Server(ThreadingHTTPServer):
    allow_reuse_address = True  # daemon_threads: exit never waits on keep-alive connections
    request_queue_size = 64  # a burst of lanes connecting at once is queued, not dropped
    in_flight, last, lock = 0, time.monotonic(), threading.Lock()  # idle counts from start

    def verify_request(self, request, client_address):
        """In the accepting thread, before any handler thread or read: a peer the allow-list
        refuses is closed unanswered, and a connection past --max-connections gets 503."""
        ip = plain_ip(client_address[0])
        if ip is None or not (ip in self.allow or ip.is_loopback and self.loopback):
            self.log(f"{ip or '-'} refused")
            return False
        if not self.slots.acquire(blocking=False):
            self.log(f"{ip} busy 503")
            try:
                request.setblocking(False)
                request.send(BUSY)
            except OSError:
                pass
            return False
        return True

    def process_request(self, request, client_address):
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: none will give the slot back
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def whole(self, name):
        """A descriptor of the file at `name`'s path now: the one kept since start (or since it
        first appeared, --growing) while the path still names that file, else the file there
        now, opened and kept instead; None while the path is absent. A descriptor replaced is
        never closed (a reply in flight may still read it): md-share lives for one apply."""
        with self.open_lock:
            path, kept = self.files[name], self.fds.get(name)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                return None
            if kept is not None:
                was = os.fstat(kept)
                if (was.st_dev, was.st_ino) == (now.st_dev, now.st_ino):
                    return kept
            try:
                self.fds[name] = open_regular(path)  # OSError for a symlink there: a 500
            except FileNotFoundError:  # removed since the look above
                return None
            return self.fds[name]

    def track(self, delta):
        """Requests in flight and when one last began or ended: what --idle watches."""
        with self.lock:
            self.in_flight, self.last = self.in_flight + delta, time.monotonic()

    def idle_for(self):
        with self.lock:
            return 0.0 if self.in_flight else time.monotonic() - self.last

    def server_bind(self):
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn) that can stall for seconds.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (ConnectionError, socket.timeout)):
            self.log(f"{client_address[0]} connection error: {sys.exc_info()[1]!r}")
        else:
            super().handle_error(request, client_address)


def main():
    p = argparse.ArgumentParser(description="Serve byte ranges of GGUF files for one apply.")
    p.add_argument("--bind", required=True, metavar="ADDR", help="IPv4 or IPv6 literal")
    p.add_argument("--port", required=True, type=int)
    p.add_argument("--allow", required=True, action="append", metavar="IP",
                   help="a client allowed to fetch (repeatable)")
    p.add_argument("--no-loopback", action="store_true",
                   help="refuse even the host itself (loopback is allowed by default)")
    p.add_argument("--file", required=True, action="append", metavar="NAME=PATH",
                   help="serve PATH as /models/NAME (repeatable)")
    p.add_argument("--growing", action="append", default=[], metavar="NAME=PARTIAL:SIZE",
                   help="while NAME's PATH is absent, serve PARTIAL as it grows to SIZE bytes")
    p.add_argument("--wait", type=float, default=120, metavar="SECONDS",
                   help="how long a growing file may stall before its reply is cut short")
    p.add_argument("--idle", required=True, type=float, metavar="SECONDS",
                   help="exit after this long with no request in flight")
    p.add_argument("--max", required=True, type=float, metavar="SECONDS",
                   help="exit this long after start, busy or not")
    p.add_argument("--max-connections", type=int, default=64, metavar="N",
                   help="connections served at once; more are answered 503")
    p.add_argument("--head-timeout", type=float, default=10, metavar="SECONDS",
                   help="how long a request's line and headers (or a kept-alive wait) may take")
    p.add_argument("--pid-file", required=True, metavar="PATH",
                   help="written once listening, removed on exit")
    p.add_argument("--log", metavar="PATH", help="log file (default: stderr)")
    args = p.parse_args()
    try:
        bind = ipaddress.ip_address(args.bind)
    except ValueError as e:
        p.error(str(e))
    allow = {plain_ip(a) for a in args.allow}
    if None in allow:
        p.error(f"--allow {args.allow}: want IP addresses")
    growing = {}
    for spec in args.growing:
        name, _, rest = spec.partition("=")
        partial, _, size = rest.rpartition(":")
        if name in growing or not partial or not size.isdigit():
            p.error(f"--growing {spec!r}: want NAME=PARTIAL:SIZE, NAME new")
        growing[name] = (partial, int(size))
    files, fds = {}, {}
    for spec in args.file:
        name, _, path = spec.partition("=")
        if name in files or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            p.error(f"--file {spec!r}: want NAME=PATH, NAME plain and new")
        files[name] = path
        try:  # opened here, and kept while the path names this file (Server.whole)
            fds[name] = open_regular(path)
        except FileNotFoundError:
            if name not in growing:
                p.error(f"--file {spec!r}: no such file (and no --growing names it)")
        except OSError as e:
            why = "a symbolic link" if e.errno in (errno.ELOOP, errno.EMLINK) else e.strerror
            p.error(f"--file {spec!r}: {why}; want a regular file")

    stop = []  # the signal handler only appends: taking locks there could deadlock
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda n, _: stop.append(signal.Signals(n).name))

    out = open(args.log, "a") if args.log else sys.stderr
    out_lock = threading.Lock()

    def log(line):
        with out_lock:
            out.write(f"{time.time():.3f} {line}\n")
            out.flush()

    start = time.monotonic()
    Server.address_family = socket.AF_INET6 if bind.version == 6 else socket.AF_INET
    try:
        server = Server((str(bind), args.port), Handler)
    except OSError as e:
        print(f"md-share: cannot listen on {bind} port {args.port}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    server.files, server.allow, server.loopback = files, allow, not args.no_loopback
    server.fds, server.open_lock = fds, threading.Lock()
    server.slots = threading.BoundedSemaphore(max(1, args.max_connections))
    server.growing, server.wait, server.head_timeout = growing, args.wait, args.head_timeout
    server.log = log
    log(f"listening {server.server_address[0]} {server.server_address[1]}")

    pid = f"{os.getpid()}\n"
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.pid_file)))
    with os.fdopen(fd, "w") as f:
        f.write(pid)
    os.replace(tmp, args.pid_file)  # appears whole, and only once we are listening

    threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True).start()
    reason = None
    while reason is None:
        time.sleep(0.1)
        reason = (stop[0] if stop else "max" if time.monotonic() - start >= args.max
                  else "idle" if server.idle_for() >= args.idle else None)
    server.shutdown()
    server.server_close()
    try:  # another starter may have taken the pid file over: leave theirs alone
        with open(args.pid_file) as f:
            if f.read() == pid:
                os.unlink(args.pid_file)
    except OSError:
        pass
    log(f"exit {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
