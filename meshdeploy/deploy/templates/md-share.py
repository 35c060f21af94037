#!/usr/bin/env python3
"""md-share: serve byte ranges of verified GGUF files to the cluster's other hosts.

During an apply, a worker that lacks a model fetches only the tensors it holds, as byte ranges
of a copy another host has already verified, instead of downloading the whole model from the
internet. meshdeploy starts this on that host and it must not outlive the apply, so it is shaped
to be safe to leave running by mistake:

- short-lived: it exits by itself after --idle seconds with no request in flight, or --max
  seconds after start, or on SIGTERM/SIGINT; the pid file (written atomically once listening)
  tells the starter it is up, and is removed on exit;
- one purpose: GET/HEAD of /models/<NAME> for the files named on the command line, nothing else;
- range-only semantics kept strict (one range per request) so a fetch can never be misread;
- allow-list: the firewall restricts the port, and this is the second fence;
- zero-copy: bodies go out with sendfile, so serving a multi-GiB model costs little CPU;
- pipelined: a file still being downloaded (--growing) is served from its partial as its bytes
  arrive, so a host copying the model trails the download instead of waiting for its end. The
  copy is verified whole (sha256) by the host that receives it, before anything uses it.

Python 3.9+, standard library only: it runs on hosts where meshdeploy is not installed.
"""

import argparse
import ipaddress
import os
import re
import signal
import socket
import socketserver
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")


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


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every reply carries Content-Length
    timeout = 120  # drop idle keep-alive connections and clients that stop reading

    def handle_one_request(self):
        self.status, self.first, self.sent, self.busy = None, "-", 0, False
        try:
            super().handle_one_request()
        finally:
            if self.busy:
                self.server.track(-1)
            if self.status is not None:  # None: the client closed without asking anything
                ip = plain_ip(self.client_address[0]) or "-"
                path = "".join(c if c.isprintable() and c != " " else "?"
                               for c in getattr(self, "path", "-"))[:300]  # one line, always
                self.server.log(f"{ip} {self.command or '-'} {path} "
                                f"{self.status} {self.first} {self.sent}")

    def log_request(self, code="-", size="-"):
        self.status = int(code)  # our own line is written once the body is out

    def log_message(self, *args):
        pass  # the default writes to stderr, and some of its messages quote headers

    def version_string(self):
        return "md-share"

    def parse_request(self):
        self.server.track(+1)
        self.busy = True
        if not super().parse_request():
            return False
        ip = plain_ip(self.client_address[0])
        if ip is None or not (ip in self.server.allow or ip.is_loopback and self.server.loopback):
            self.reply(403, close=True)
            return False
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
        """(file, size): the whole file, or, while it is still arriving (--growing), its partial
        and the size it will have; None when neither appears within --wait seconds."""
        path, growing = self.server.files[name], self.server.growing.get(name)
        deadline = time.monotonic() + self.server.wait
        while True:
            for candidate in (path,) + ((growing[0],) if growing else ()):
                try:
                    f = open(candidate, "rb")
                except FileNotFoundError:
                    continue  # renamed between two looks: the next round finds the whole file
                if candidate == path:
                    return f, os.fstat(f.fileno()).st_size
                return f, growing[1]
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
        f, size = opened
        with f:
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
    in_flight, last, lock = 0, time.monotonic(), threading.Lock()  # idle counts from start

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
    files = {}
    for spec in args.file:
        name, _, path = spec.partition("=")
        if name in files or not re.fullmatch(r"[A-Za-z0-9._-]+", name) or \
                not (os.path.isfile(path) or name in growing):
            p.error(f"--file {spec!r}: want NAME=PATH, NAME plain and new, PATH an existing file "
                    "(or one --growing names)")
        files[name] = path

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
    server.growing, server.wait = growing, args.wait
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
