"""md-failover: one llama-server, started on the placement for the workers that answer, and
switched when a worker goes away or comes back. Python's standard library only.

meshdeploy writes it beside its other tools and starts it in llama-server's place (the server's
unit, runit run script or launchd job), with python3 -I; the plan computes every placement:

  md-failover.py [--state FILE] [--url URL] [--front ADDR:PORT] [--interval S] [--settle N]
                 [--rpc-flag=F] [--ts-flag=F] --worker NAME=ADDR:PORT[,ADDR:PORT...] ...
                 --placement LOST RPC TS ...  -- LLAMA-SERVER ARGV...

LOST: the worker names away, comma-separated ("-": none, the full placement); RPC: the --rpc
value for it ("-": none); TS: the -ts value ("-": llama.cpp's own split by free memory). The
placements come in the plan's order: the full one first, then fewer workers. URL: where the
server answers on its own host (for /metrics).

- Before llama-server starts, every worker is asked for rpc-server's HELLO (a connect, one
  request, a short deadline), and the first placement that dials only workers that answer is
  started. A worker no placement dials (one given no layers) never matters. With no placement
  for what answers, the server is down until a worker comes back: it says so in its log and
  state file, and asks again every interval.
- While it serves, llama-server's own connections to its workers are watched: each is taken
  out of the process for a moment (pidfd_getfd, Linux 5.6+) and given TCP keepalive and a user
  timeout, and the copy closed; the kernel's table (/proc/net/tcp) then says when one fails
  (a link that drops silently: within about 4 s), is closed by the worker, or stays unanswered
  while llama-server connects. No probe ever connects to a worker llama-server is using:
  rpc-server serves one client at a time, and a probe would wait in the backlog the next
  llama-server needs.
- A link that dropped silently leaves the worker's rpc-server waiting on the dead connection
  (it sets no keepalive), and a waiting rpc-server accepts nobody: before each HELLO to a lost
  worker, a connect from the dead connection's own local address makes the worker's kernel
  reset it (see nudge()).
- A worker the running placement does not dial is asked for HELLO every interval; once it
  answers `settle` times in a row and an earlier (fuller) placement can run, md-failover waits
  for the requests in flight to finish (/metrics' requests_processing, at most DRAIN seconds;
  HOLD seconds where /metrics cannot say) and restarts llama-server on it. A worker lost again
  soon after it came back must answer twice as long the next time (up to MAX_SETTLE).
- With --front ADDR:PORT, md-failover holds the server's own address and llama-server listens
  on a Unix socket beside the state file (--host PATH.sock, llama-server's own option): a
  request that arrives while llama-server (re)starts on another placement waits (HOLD_MAX)
  and is then relayed, instead of being refused; a health probe (GET /health) is told 503 at
  once, as llama-server answers while it loads. Before a switch back the front takes no new
  request to llama-server, and the switch waits until the relayed connections are quiet.
- A llama-server that exits while every worker it dials still answers ends md-failover with its
  exit status: the service manager restarts it, as it would llama-server itself. md-failover
  stops llama-server whenever it ends itself (and llama-server gets SIGTERM should md-failover
  die without that).
"""

import argparse
import concurrent.futures
import ctypes
import errno
import http.client
import json
import os
import signal
import socket
import struct
import selectors
import subprocess
import sys
import threading
import time
import urllib.parse

HELLO_TIMEOUT = 1.0  # seconds a worker has to accept and answer HELLO, all of it (a LAN)
HELLO_TRIES = 3  # a worker llama-server just used may still be finishing its last graph
REPLY_MAX = 64  # a HELLO reply is a few bytes: a longer one is not rpc-server's
KEEPIDLE, KEEPINTVL, KEEPCNT = 2, 1, 2  # seconds idle, between probes, probes: a silent loss
USER_TIMEOUT_MS = 4000  # ... fails the connection in about 4 s, idle or sending
DRAIN = 120  # seconds to wait for requests in flight before switching back
HOLD = 5  # seconds to wait instead where /metrics cannot say what is in flight
STOP_WAIT = 15  # seconds llama-server has to exit after SIGTERM
FLAP = 120  # seconds: a worker lost again this soon after it came back is flapping
MAX_SETTLE = 64  # the most answers in a row a flapping worker must give to count as back
HOLD_MAX = 120  # seconds a request waits at the front while llama-server (re)starts
QUIET = 1.0  # seconds without a byte on any relayed connection before a switch back
PEEK = 2.0  # seconds a new client has to send its request line, for a health probe's answer
SUN_PATH_MAX = 100  # a Unix socket's path must fit sockaddr_un (108 bytes on Linux)
SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture
PR_SET_PDEATHSIG = 1


def log(message):
    print(f"md-failover: {message}", file=sys.stderr, flush=True)


ANSWERED, NO_ANSWER, UNREACHABLE = "answered", "no answer", "unreachable"


def hello(target, deadline=HELLO_TIMEOUT):
    """Whether rpc-server answers HELLO at "addr:port" within `deadline` seconds in all (a
    forward whose worker is gone accepts the connect and then closes it: only the reply
    counts; a listener that dribbles its reply out does not hold the caller longer):
    ANSWERED; UNREACHABLE when every connect timed out (nothing answered the SYN: a link that is
    down, or a backlog full of queued clients); NO_ANSWER otherwise (refused, closed, or no
    reply: a worker still finishing its last graph, an rpc-server restarting)."""
    addr, _, port = target.rpartition(":")
    end = time.monotonic() + deadline
    try:
        infos = socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return NO_ANSWER
    if not infos:
        return NO_ANSWER
    s, timed_out = None, True
    for i, (family, kind, proto, _, address) in enumerate(infos):
        left = (end - time.monotonic()) / (len(infos) - i)  # a share for each address left
        if left <= 0:
            break
        try:
            s = socket.socket(family, kind, proto)
            s.settimeout(left)
            s.connect(address)
            break
        except socket.timeout:
            pass
        except OSError:
            # refused or unreachable at once (someone answered), or no such socket here
            timed_out = False
        if s is not None:
            s.close()
            s = None
    if s is None:
        return UNREACHABLE if timed_out else NO_ANSWER
    try:
        s.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))
        size = struct.unpack("<Q", _recv(s, 8, end))[0]
        ok = size <= REPLY_MAX and len(_recv(s, size, end)) == size
        return ANSWERED if ok else NO_ANSWER
    except (OSError, EOFError, struct.error):
        return NO_ANSWER
    finally:
        s.close()


def _recv(s, n, end):
    data = b""
    while len(data) < n:
        left = end - time.monotonic()
        if left <= 0:
            raise EOFError
        s.settimeout(left)
        chunk = s.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def nudge(local, target):
    """A connect from the local end of a connection that died silently: the worker's rpc-server
    may still wait on its end (it never heard of the loss, and sets no keepalive), holding its
    one client place. The SYN on that same address pair makes the worker's kernel answer with
    an ACK for the old connection, which this kernel answers with a reset, which ends it
    there: rpc-server accepts again. Whatever the connect does is of no further interest."""
    addr, _, port = target.rpartition(":")
    s = socket.socket(socket.AF_INET6 if ":" in local[0] else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(local[:2])
        s.settimeout(0.5)
        s.connect((addr, int(port)))
    except (OSError, ValueError):
        pass
    finally:
        s.close()


def _address(hexed):
    """"0C00C80A:C350" (/proc/net/tcp's remote end, IPv4) -> "10.200.0.12:50000"."""
    addr, _, port = hexed.partition(":")
    if len(addr) != 8:
        return None
    try:
        return f"{socket.inet_ntoa(struct.pack('=I', int(addr, 16)))}:{int(port, 16)}"
    except ValueError:
        return None


_ABSENT = ("", "", False)  # a connection's (state, remote end, failing) when the table lacks it


def _failing(w):
    """Whether a row of /proc/net/tcp (split into words) shows data or keepalive probes its
    peer has not answered: the retransmission count (hexadecimal) or the unanswered probe count
    (decimal) at 2 or more. A link that drops silently reaches one of them in the seconds
    before the user timeout ends the connection (tests/unit/test_md_failover.py has rows read
    during such a cut); a live peer, however busy its program, acknowledges at once (one
    probe or one retransmission awaiting its answer is a round trip's normal state)."""
    try:
        return int(w[6], 16) >= 2 or int(w[8]) >= 2
    except (IndexError, ValueError):
        return False


def _parent_death_signal():
    """In llama-server, before exec: SIGTERM when md-failover dies (Linux), so a killed
    md-failover never leaves it holding the port and every worker's one client place."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class UnixHTTP(http.client.HTTPConnection):
    """HTTP to llama-server's Unix socket."""

    def __init__(self, path, timeout):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(self.timeout)
        s.connect(self.unix_path)
        self.sock = s


def _unavailable(c, why):
    """Answers 503 as llama-server does while it loads, after reading what the client sent
    (a close with unread data would reset the connection before the client reads the answer)."""
    body = json.dumps({"error": {"code": 503, "message": why,
                                 "type": "unavailable_error"}}).encode()
    try:
        c.settimeout(1.0)
        c.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
        c.shutdown(socket.SHUT_WR)
        while c.recv(65536):
            pass
    except OSError:
        pass


class Front:
    """The server's address, held by md-failover; llama-server behind it on a Unix socket. A
    client waits here while llama-server is not ready, and is relayed once it is."""

    def __init__(self, listen, backend):
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, int(port)))
        self.sock.listen(128)
        self.backend = backend
        self.ready = threading.Event()
        self.down = None  # why no llama-server runs, while none can
        self.closing = False
        self.lock = threading.Lock()
        self.active = {}  # relayed connection -> when its last byte passed
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self):
        self.closing = True
        self.ready.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def quiet(self):
        """Whether no relayed connection has passed a byte for QUIET seconds."""
        now = time.monotonic()
        with self.lock:
            return all(now - t >= QUIET for t in self.active.values())

    def _accept(self):
        while not self.closing:
            try:
                c, _ = self.sock.accept()
            except OSError:
                if self.closing:
                    return
                time.sleep(0.1)
                continue
            threading.Thread(target=self._client, args=(c,), daemon=True).start()

    def _health_probe(self, c):
        """Whether the client's request is GET /health (it waits at most PEEK for it)."""
        end = time.monotonic() + PEEK
        data = b""
        while len(data) < 12 and time.monotonic() < end:
            try:
                c.settimeout(max(0.01, end - time.monotonic()))
                data = c.recv(12, socket.MSG_PEEK)
            except OSError:
                return False
            if not data:
                return False
            if len(data) < 12:
                time.sleep(0.05)
        return data.startswith(b"GET /health")

    def _client(self, c):
        try:
            if not self.ready.is_set() and self._health_probe(c):
                return _unavailable(c, self.down or "Loading model")
            deadline = time.monotonic() + HOLD_MAX
            while True:
                while not self.ready.wait(0.2):
                    if self.closing or self.down or time.monotonic() > deadline:
                        return _unavailable(c, self.down or "llama-server is not ready")
                b = socket.socket(socket.AF_UNIX)
                try:
                    b.connect(self.backend)
                    break
                except OSError:  # it ended before md-failover saw it: wait for the next one
                    b.close()
                    if time.monotonic() > deadline:
                        return _unavailable(c, "llama-server does not answer")
                    time.sleep(0.2)
            c.settimeout(None)
            self._relay(c, b)
        finally:
            c.close()

    def _relay(self, c, b):
        other = {c: b, b: c}
        sel = selectors.DefaultSelector()
        for s in other:
            sel.register(s, selectors.EVENT_READ)
        key = object()
        with self.lock:
            self.active[key] = time.monotonic()
        try:
            open_ = 2
            while open_:
                for k, _ in sel.select():
                    s = k.fileobj
                    data = s.recv(65536)
                    with self.lock:
                        self.active[key] = time.monotonic()
                    if data:
                        other[s].sendall(data)
                        continue
                    sel.unregister(s)
                    open_ -= 1
                    if s is b:  # llama-server ended the connection: nothing more comes
                        return
                    other[s].shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            with self.lock:
                del self.active[key]
            sel.close()
            b.close()


class Placement:
    def __init__(self, lost, rpc, ts):
        self.lost = frozenset(x for x in lost.split(",") if x) if lost != "-" else frozenset()
        self.rpc = None if rpc == "-" else rpc
        self.ts = None if ts == "-" else ts
        self.targets = [t for t in (self.rpc or "").split(",") if t]

    def describe(self):
        return "the full placement" if not self.lost else \
            "the placement without " + ", ".join(sorted(self.lost))


class Supervisor:
    def __init__(self, opts):
        self.opts = opts
        self.workers = {}  # name -> [targets]
        for spec in opts.worker:
            name, _, targets = spec.partition("=")
            self.workers[name] = [t for t in targets.split(",") if t]
        self.owner = {t: n for n, ts in self.workers.items() for t in ts}
        self.placements = [Placement(*p) for p in opts.placement]
        self.base = opts.argv
        self.child = None
        self.stopping = False
        self.watching = sys.platform.startswith("linux")
        self.seen = set()
        self.armed = {}  # socket inode of llama-server's -> the worker at its other end
        self.connecting = {}  # socket inode of llama-server's in SYN_SENT -> since when
        # workers whose connection from llama-server, at the last read of the kernel's table,
        # had data or keepalive probes unanswered (_failing: a count at 2 or more)
        self.failing = set()
        # worker -> {((addr, port), target)}: the local ends of llama-server's connections to
        # it, and (once it is lost) of those whose other end may still wait on the worker
        self.local = {}
        self.stale = {}
        self.last_state = None
        self.settle = {n: opts.settle for n in self.workers}  # answers in a row to be back
        self.back_at = {}  # worker -> when it last came back
        self.state_file = opts.state or (
            os.path.join(os.environ["RUNTIME_DIRECTORY"], "failover.json")
            if os.environ.get("RUNTIME_DIRECTORY") else None)
        self.front = None  # Front, where md-failover holds the server's address
        self.key = self._key()  # the API key, read once: /health is asked every 0.25 s

    def dials(self, placement):
        """The workers `placement` dials."""
        return {self.owner[t] for t in placement.targets if t in self.owner}

    def resolve(self):
        """Maps each target's addresses too: a worker named by DNS is seen by its address in
        the kernel's table and in getpeername()."""
        for name, targets in self.workers.items():
            for t in targets:
                addr, _, port = t.rpartition(":")
                try:
                    infos = socket.getaddrinfo(addr, int(port), proto=socket.IPPROTO_TCP)
                except (OSError, ValueError):
                    continue
                for info in infos:
                    self.owner.setdefault(f"{info[4][0]}:{info[4][1]}", name)

    # --- what answers -------------------------------------------------------------------------
    def answering(self, names, tries=1, failing=()):
        """The workers among `names` whose every rpc-server answers HELLO, asked at once (a
        lost worker's dead connections nudged first); `tries` asks a silent one again. A worker
        in `failing` (llama-server's connection to it was retransmitting or probing unanswered
        when last read) is not asked again once its connect times out: its link is down, and
        asking again would only keep the server down longer. Any other worker's timed-out
        connect may be a live rpc-server with its backlog full of queued probes, still
        finishing its last graph: it is asked again."""
        names = list(names)
        targets = [t for n in names for t in self.workers[n]]
        if not targets:
            return set()

        def ask(target):
            name = self.owner.get(target)
            final = name in failing
            for local, t in self.stale.get(name, ()):
                if t == target:
                    nudge(local, t)
            for i in range(tries):
                answer = hello(target)
                if answer == ANSWERED:
                    return True
                if answer == UNREACHABLE and final:
                    return False
                if i + 1 < tries:
                    time.sleep(0.5)
            return False

        with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
            ok = dict(zip(targets, pool.map(ask, targets)))
        return {n for n in names if all(ok[t] for t in self.workers[n])}

    def placement_for(self, answering):
        """The first placement (the plan's order: the fullest first) that dials only workers
        that answer."""
        return next((p for p in self.placements if self.dials(p) <= set(answering)), None)

    # --- state --------------------------------------------------------------------------------
    def state(self, what, placement=None, lost=()):
        record = {"state": what, "lost": sorted(lost),
                  "rpc": placement.rpc if placement else None,
                  "ts": placement.ts if placement else None,
                  "pid": self.child.pid if self.child else None}
        if record == self.last_state:
            return
        self.last_state = dict(record)
        record["since"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        path = self.state_file
        if not path:
            return
        try:
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.chmod(tmp, 0o644)  # `meshdeploy status` reads it as the login user
            os.replace(tmp, path)
        except OSError as exc:
            log(f"cannot write {path}: {exc}")

    # --- llama-server -------------------------------------------------------------------------
    def argv(self, placement):
        out = list(self.base)
        if placement.rpc:
            out += [self.opts.rpc_flag, placement.rpc]
        if placement.ts:
            out += [self.opts.ts_flag, placement.ts]
        if self.front is not None:  # the last --host wins: the front holds the address
            out += ["--host", self.front.backend]
        return out

    def backend(self):
        """Where llama-server listens behind the front: beside the state file; None where
        there is no such folder, or its path is too long for a Unix socket."""
        if not self.state_file:
            return None
        head = self.state_file[:-len("failover.json")] \
            if self.state_file.endswith("failover.json") else self.state_file + "."
        path = head + "llama.sock"
        return path if len(path.encode()) <= SUN_PATH_MAX else None

    def start(self, placement):
        self.seen.clear()
        self.local = {}
        self.failing = set()
        if self.front is not None:
            self.front.down = None
            try:
                os.unlink(self.front.backend)  # a socket file left by the last one
            except FileNotFoundError:
                pass
        self.child = subprocess.Popen(self.argv(placement), stdin=subprocess.DEVNULL,
                                      preexec_fn=_parent_death_signal)
        log(f"llama-server started on {placement.describe()} (pid {self.child.pid}"
            + (f", --rpc {placement.rpc}" if placement.rpc else ", no rpc-server") + ")")
        if self.front is not None:
            threading.Thread(target=self._await_health, args=(self.child,), daemon=True).start()

    def _get(self, path, timeout):
        """(status, body) of a GET to llama-server: through its Unix socket behind the front,
        else at --url; None when it does not answer."""
        if self.front is not None:
            conn = UnixHTTP(self.front.backend, timeout)
        elif self.opts.url:
            u = urllib.parse.urlsplit(self.opts.url)
            conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
        else:
            return None
        try:
            conn.request("GET", path,
                         headers={"Authorization": f"Bearer {self.key}"} if self.key else {})
            r = conn.getresponse()
            return r.status, r.read(1 << 20).decode("utf-8", "replace")
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    def _await_health(self, child):
        """Opens the front once `child` answers /health with 200."""
        while self.child is child and child.poll() is None and not self.stopping:
            answer = self._get("/health", 1.0)
            if answer is not None and answer[0] == 200:
                if self.child is child:
                    self.front.ready.set()
                return
            time.sleep(0.25)

    def stop_child(self, why):
        if self.front is not None:
            self.front.ready.clear()  # new requests wait for the next llama-server
        if self.child is None:
            return None
        if self.child.poll() is None:
            log(f"stopping llama-server: {why}")
            self.child.terminate()
            try:
                self.child.wait(STOP_WAIT)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
        code = self.child.returncode
        self.child = None
        self.release()
        return code

    def release(self):
        """Forgets the connections of a llama-server that ended."""
        self.armed.clear()
        self.connecting.clear()

    def unwatch(self, why):
        self.watching = False
        log(f"cannot watch llama-server's connections ({why}): a worker that goes away "
            "silently is noticed when llama-server aborts at its next request instead")

    # --- watching the connections in use -----------------------------------------------------
    def adopt(self):
        """Arms every new connection of llama-server to a worker: keepalive and a user timeout
        set on it through a copy taken with pidfd_getfd, the copy closed at once (a copy kept
        open would keep the connection open after llama-server closes it, and the worker's
        rpc-server, which serves one client at a time, would wait on it for ever)."""
        if not self.watching or self.child is None:
            return
        pid = self.child.pid
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            return  # it is ending
        try:
            pidfd = os.pidfd_open(pid)
        except AttributeError:
            return self.unwatch("this Python has no os.pidfd_open")
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                return
            return self.unwatch(os.strerror(exc.errno or 0))
        current = set()
        try:
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if not link.startswith("socket:["):
                    continue
                current.add(link)
                if link not in self.seen and self.watching:
                    self._arm(pidfd, int(fd), link[8:-1])
        finally:
            os.close(pidfd)
        self.seen &= current  # a socket llama-server closed (an HTTP client's) is forgotten

    def _arm(self, pidfd, fd, inode):
        libc = ctypes.CDLL(None, use_errno=True)
        dup = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if dup < 0:
            err = ctypes.get_errno()
            if err in (errno.EPERM, errno.ENOSYS, errno.EACCES):
                self.unwatch(os.strerror(err))
            return
        try:
            s = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            self.seen.add(f"socket:[{inode}]")  # not a socket Python knows: not TCP
            return
        try:
            try:
                peer = s.getpeername()
            except OSError as exc:
                if exc.errno != errno.ENOTCONN or \
                        s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    self.seen.add(f"socket:[{inode}]")  # a listener, or no TCP at all
                return  # still connecting: armed at a later look
            self.seen.add(f"socket:[{inode}]")
            name = self.owner.get(f"{peer[0]}:{peer[1]}") if isinstance(peer, tuple) else None
            if name is None:
                return  # a client of the server's, or anything but a worker
            s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for opt, value in (("TCP_KEEPIDLE", KEEPIDLE), ("TCP_KEEPINTVL", KEEPINTVL),
                               ("TCP_KEEPCNT", KEEPCNT), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
                if hasattr(socket, opt):
                    s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
            self.armed[inode] = name
            self.local.setdefault(name, set()).add((s.getsockname(), f"{peer[0]}:{peer[1]}"))
        except OSError:
            pass  # it closed meanwhile
        finally:
            s.close()

    def hung_up(self, timeout):
        """Workers whose connection from llama-server failed (a timeout or a reset takes it
        out of the kernel's table) or was closed by their end (CLOSE_WAIT), or that llama-server
        has been trying to reach for longer than the user timeout (SYN_SENT: a worker gone
        while llama-server loads would otherwise keep it loading for minutes), after `timeout`
        seconds. The table is read before llama-server's descriptors, so a connection that
        llama-server closes itself meanwhile is not taken for a loss."""
        time.sleep(timeout)
        if self.child is None or not self.watching:
            return set()
        table, read = {}, False
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(name) as f:
                    rows = f.read().splitlines()[1:]
            except OSError:
                continue
            read = True
            for row in rows:
                w = row.split()
                if len(w) > 9:
                    table[w[9]] = (w[3], w[2], _failing(w))
        if not read:
            # Without the table every connection would look gone (Android keeps it from apps).
            self.unwatch("the kernel's connection table cannot be read")
            return set()
        try:
            mine = set()
            for fd in os.listdir(f"/proc/{self.child.pid}/fd"):
                link = os.readlink(f"/proc/{self.child.pid}/fd/{fd}")
                if link.startswith("socket:["):
                    mine.add(link[8:-1])
        except OSError:
            return set()  # it is ending: its exit says the rest
        if self.child.poll() is not None:
            # It ended (an unreaped llama-server lists no descriptors): what was read of its
            # connections stays as it was for the exit's handling (failing).
            return set()
        for inode in [i for i in self.armed if i not in mine]:
            del self.armed[inode]  # closed by llama-server itself
        gone = {name for inode, name in self.armed.items() if table.get(inode, _ABSENT)[0] != "01"}
        self.failing = {name for inode, name in self.armed.items()
                        if table.get(inode, _ABSENT)[2]}
        now = time.monotonic()
        for inode in [i for i in self.connecting if i not in mine or
                      table.get(i, _ABSENT)[0] != "02"]:
            del self.connecting[inode]
        for inode in mine - set(self.armed):
            state, remote, _ = table.get(inode, _ABSENT)
            name = self.owner.get(_address(remote)) if state == "02" else None
            if name is None:
                continue
            since = self.connecting.setdefault(inode, now)
            if now - since > USER_TIMEOUT_MS / 1000:
                gone.add(name)
        return gone

    # --- in flight ----------------------------------------------------------------------------
    def _key(self):
        args = self.base
        for i, a in enumerate(args[:-1]):
            if a == "--api-key-file":
                try:
                    with open(args[i + 1]) as f:
                        return f.readline().strip()
                except OSError:
                    return None
        return None

    def requests_processing(self):
        """What /metrics says is in flight; None where it cannot say (no --metrics, an error)."""
        answer = self._get("/metrics", 2.0)
        if answer is None or answer[0] != 200:
            return None
        for line in answer[1].splitlines():
            if line.startswith("llamacpp:requests_processing"):
                try:
                    return float(line.split()[-1])
                except ValueError:
                    return None
        return None

    def drain(self):
        """Waits (at most DRAIN seconds) until llama-server processes no request; HOLD seconds
        where /metrics cannot say."""
        deadline = time.monotonic() + DRAIN
        while time.monotonic() < deadline and not self.stopping:
            busy = self.requests_processing()
            if busy is None:
                time.sleep(HOLD)
                return False
            # Behind the front, a relayed connection may carry a request /metrics does not
            # count yet: the switch also waits until none passed a byte for QUIET seconds.
            if busy == 0 and (self.front is None or self.front.quiet()):
                return True
            time.sleep(0.5)
        return False

    # --- the loop -----------------------------------------------------------------------------
    def serve(self, placement, lost):
        """Runs llama-server on `placement` until it exits, a worker it dials is lost, or a
        fuller placement can run. Returns ("exited", code), ("lost", names) or
        ("back", (names, placement))."""
        self.start(placement)
        self.state("serving", placement, lost)
        idle = [n for n in self.workers if n not in self.dials(placement)]
        count = {n: 0 for n in idle}
        next_probe = time.monotonic() + self.opts.interval
        while not self.stopping:
            code = self.child.poll()
            if code is not None:
                if self.front is not None:
                    self.front.ready.clear()  # requests wait for the next one
                self.release()
                return "exited", code
            self.adopt()
            gone = self.hung_up(min(1.0, self.opts.interval))
            if gone:
                return "lost", gone
            if idle and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self.opts.interval
                ok = self.answering(idle)
                for n in idle:
                    count[n] = count[n] + 1 if n in ok else 0
                settled = {n for n in idle if count[n] >= self.settle[n]}
                better = self.placement_for(self.dials(placement) | settled)
                if better is not None and self.placements.index(better) < \
                        self.placements.index(placement):
                    return "back", (settled & self.dials(better), better)
        return "stop", None

    def lose(self, names):
        """Remembers what a loss leaves behind: the dead connections to nudge, and a worker
        that flaps (lost again soon after it came back) must answer longer next time."""
        now = time.monotonic()
        for name in names:
            self.stale[name] = set(self.local.get(name, set()))
            if now - self.back_at.get(name, -FLAP) < FLAP:
                self.settle[name] = min(self.settle[name] * 2, MAX_SETTLE)
                log(f"{name} was lost again {now - self.back_at[name]:.0f} s after it came "
                    f"back: it must answer {self.settle[name]} times in a row next time")

    def run(self):
        just_lost, down_before, placement = set(), None, None
        self.resolve()
        if not self.watching:
            self.unwatch(f"{sys.platform} has no pidfd_getfd and no /proc/net/tcp")
        while not self.stopping:
            # Right after a loss, the workers the placement dialed besides the lost ones are
            # taken as they were (their connections were sound until llama-server stopped; a
            # HELLO now could find one still finishing its last graph); the others are asked.
            if just_lost:
                answering = set(self.dials(placement)) - just_lost
                answering |= self.answering(
                    [n for n in self.workers if n not in answering | just_lost])
            else:
                answering = self.answering(list(self.workers))
            for name in set(self.stale) & answering:
                del self.stale[name]  # it answered: nothing of the old connection is left
            just_lost = set()
            placement = self.placement_for(answering)
            away = set(self.workers) - answering
            if placement is None:
                if away != down_before:
                    log(f"down while {', '.join(sorted(away))} "
                        f"{'is' if len(away) == 1 else 'are'} away: no placement without "
                        "them (see the plan's Failover lines)")
                down_before = away
                if self.front is not None:
                    self.front.down = (f"down while {', '.join(sorted(away))} "
                                       f"{'is' if len(away) == 1 else 'are'} away")
                self.state("down", None, away)
                time.sleep(self.opts.interval)
                continue
            down_before = None
            if self.stopping:
                break
            what, detail = self.serve(placement, placement.lost)
            if what == "lost":
                just_lost = set(detail)
                self.lose(detail)
                log(f"lost {', '.join(sorted(detail))}: its connection from llama-server failed")
                self.stop_child(f"{', '.join(sorted(detail))} away")
            elif what == "back":
                names, better = detail
                now = time.monotonic()
                for name in names:
                    self.back_at[name] = now
                log(f"{', '.join(sorted(names))} answers again: waiting for requests in flight "
                    f"before {better.describe()}")
                if self.front is not None:
                    self.front.ready.clear()  # from now on requests wait for the next one
                self.drain()
                self.stop_child(f"{', '.join(sorted(names))} back")
            elif what == "exited":
                log(f"llama-server exited with status {detail}")
                self.child = None
                if self.stopping:
                    continue
                used = self.dials(placement)
                gone = used - self.answering(used, tries=HELLO_TRIES, failing=self.failing)
                if not gone:
                    # Not a worker's loss: the service manager restarts md-failover, as it would
                    # a llama-server that exits.
                    self.state("exited", placement, placement.lost)
                    return detail if detail else 1
                just_lost = gone  # llama-server aborted on them before they were seen lost
                self.lose(gone)
        return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="md-failover.py")
    p.add_argument("--state", help="JSON file that says which placement runs (default: "
                   "$RUNTIME_DIRECTORY/failover.json where the service manager gives one)")
    p.add_argument("--url", help="where llama-server answers on this host, for /metrics")
    p.add_argument("--front", metavar="ADDR:PORT", help="hold the server's address here, "
                   "llama-server behind it on a Unix socket beside the state file")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--settle", type=int, default=2)
    p.add_argument("--rpc-flag", default="--rpc")
    p.add_argument("--ts-flag", default="-ts")
    p.add_argument("--worker", action="append", default=[])
    p.add_argument("--placement", nargs=3, action="append", default=[],
                   metavar=("LOST", "RPC", "TS"))
    p.add_argument("argv", nargs="+")
    opts = p.parse_args(argv)
    if opts.url and urllib.parse.urlsplit(opts.url).scheme != "http":
        p.error("--url must be http://HOST:PORT")
    sup = Supervisor(opts)
    if opts.front:
        backend = sup.backend()
        if backend is None:
            log("no front: no state folder for llama-server's Unix socket (or its path is too "
                "long): llama-server holds the address itself, and refuses requests while it "
                "restarts")
        else:
            try:
                sup.front = Front(opts.front, backend)
            except (OSError, ValueError) as exc:
                log(f"cannot listen on {opts.front}: {exc}")
                return 1

    def stop(signum, frame):
        sup.stopping = True
        if sup.child is not None and sup.child.poll() is None:
            sup.child.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        return sup.run()
    finally:
        # Whatever ends md-failover ends its llama-server: never one left holding the port and
        # the workers' one client place.
        sup.stop_child("stopping")
        sup.state("stopped")
        if sup.front is not None:
            sup.front.close()


if __name__ == "__main__":
    sys.exit(main())
