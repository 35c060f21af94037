"""md-failover: one llama-server, started on the placement for the workers that answer, and
switched when a worker goes away or comes back. Python's standard library only.

meshdeploy writes it beside its other tools and starts it in llama-server's place (the server's
unit, runit run script or launchd job); the plan computes every placement it may start:

  md-failover.py [--state FILE] [--interval S] [--settle N] [--rpc-flag F] [--ts-flag F]
                 --worker NAME=ADDR:PORT[,ADDR:PORT...] ...
                 --placement LOST RPC TS ...  -- LLAMA-SERVER ARGV...

LOST: the worker names away, comma-separated ("-": none, the full placement); RPC: the --rpc
value for it ("-": none); TS: the -ts value ("-": llama.cpp's own split by free memory).

- Before llama-server starts, every worker is asked for rpc-server's HELLO (a connect, one
  request, a short timeout), and the placement for the set that does not answer is started.
  With no placement for that set, the server is down until a worker comes back: it says so
  in its log and state file, and asks again every interval.
- While it serves, llama-server's own connections to its workers are watched: they are taken
  out of the process (pidfd_getfd, Linux 5.6+) and given TCP keepalive and a user timeout, so a
  link that drops silently fails them within about 4 s, and a worker that closes its end is seen
  at once. No probe ever connects to a worker llama-server is using: rpc-server serves one
  client at a time, and a probe would wait in the backlog the next llama-server needs.
- A link that dropped silently leaves the worker's rpc-server waiting on the dead connection
  (it sets no keepalive), and a waiting rpc-server accepts nobody: before each HELLO to a lost
  worker, a connect from the dead connection's own local address makes the worker's kernel
  reset it (see nudge()).
- Where a worker is away, it is asked for HELLO every interval; once it answers `settle` times
  in a row, md-failover waits for the requests in flight to finish (/metrics'
  requests_processing, at most DRAIN seconds) and restarts llama-server on the placement for
  the workers still away.
- A llama-server that exits while every worker it uses still answers ends md-failover with its
  exit status: the service manager restarts it, as it would llama-server itself.
"""

import argparse
import concurrent.futures
import ctypes
import errno
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request

HELLO_TIMEOUT = 1.0  # seconds a worker has to accept and answer HELLO (a LAN; a forward)
REPLY_MAX = 64  # a HELLO reply is a few bytes: a longer one is not rpc-server's
KEEPIDLE, KEEPINTVL, KEEPCNT = 2, 1, 2  # seconds idle, between probes, probes: a silent loss
USER_TIMEOUT_MS = 4000  # ... fails the connection in about 4 s, idle or sending
DRAIN = 120  # seconds to wait for requests in flight before switching back
STOP_WAIT = 15  # seconds llama-server has to exit after SIGTERM
SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture


def log(message):
    print(f"md-failover: {message}", file=sys.stderr, flush=True)


def hello(target):
    """Whether rpc-server answers HELLO at "addr:port" (a forward whose worker is gone accepts
    the connect and then closes it: only the reply counts)."""
    addr, _, port = target.rpartition(":")
    try:
        s = socket.create_connection((addr, int(port)), timeout=HELLO_TIMEOUT)
    except (OSError, ValueError):
        return False
    try:
        s.sendall(bytes([14]) + struct.pack("<Q", 24) + bytes(24))
        size = struct.unpack("<Q", _recv(s, 8))[0]
        return size <= REPLY_MAX and len(_recv(s, size)) == size
    except (OSError, EOFError, struct.error):
        return False
    finally:
        s.close()


def _recv(s, n):
    data = b""
    while len(data) < n:
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
        s.settimeout(1.5)
        s.connect((addr, int(port)))
    except (OSError, ValueError):
        pass
    finally:
        s.close()


def _address(hexed):
    """"0C00C80A:C350" (/proc/net/tcp's remote end, IPv4) -> "10.200.0.12:50052"."""
    addr, _, port = hexed.partition(":")
    if len(addr) != 8:
        return None
    try:
        return f"{socket.inet_ntoa(struct.pack('=I', int(addr, 16)))}:{int(port, 16)}"
    except ValueError:
        return None


class Placement:
    def __init__(self, lost, rpc, ts):
        self.lost = frozenset(x for x in lost.split(",") if x) if lost != "-" else frozenset()
        self.rpc = None if rpc == "-" else rpc
        self.ts = None if ts == "-" else ts

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
        self.adoption = sys.platform.startswith("linux")
        self.seen = set()
        self.armed = {}  # socket inode of llama-server's -> the worker at its other end
        self.connecting = {}  # socket inode of llama-server's in SYN_SENT -> since when
        # worker -> {((addr, port), target)}: the local ends of llama-server's connections to
        # it, and (once it is lost) of those whose other end may still wait on the worker
        self.local = {}
        self.stale = {}
        self.last_state = None
        self.just_lost = set()

    # --- what answers -------------------------------------------------------------------------
    def answering(self, names):
        """The workers among `names` whose every rpc-server answers HELLO (asked at once)."""
        for name in names:
            for local, target in self.stale.get(name, ()):
                nudge(local, target)
        targets = [t for n in names for t in self.workers[n]]
        if not targets:
            return set()
        with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
            ok = dict(zip(targets, pool.map(hello, targets)))
        return {n for n in names if all(ok[t] for t in self.workers[n])}

    def placement_for(self, lost):
        return next((p for p in self.placements if p.lost == frozenset(lost)), None)

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
        path = self.opts.state or (os.path.join(os.environ["RUNTIME_DIRECTORY"],
                                                "failover.json")
                                   if os.environ.get("RUNTIME_DIRECTORY") else None)
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
        return out

    def start(self, placement):
        self.seen.clear()
        self.local = {}
        self.child = subprocess.Popen(self.argv(placement), stdin=subprocess.DEVNULL)
        log(f"llama-server started on {placement.describe()} (pid {self.child.pid}"
            + (f", --rpc {placement.rpc}" if placement.rpc else ", no rpc-server") + ")")

    def stop_child(self, why):
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

    # --- watching the connections in use -----------------------------------------------------
    def adopt(self):
        """Arms every new connection of llama-server to a worker: keepalive and a user timeout
        set on it through a copy taken with pidfd_getfd, the copy closed at once (a copy kept
        open would keep the connection open after llama-server closes it, and the worker's
        rpc-server, which serves one client at a time, would wait on it for ever)."""
        if not self.adoption or self.child is None:
            return
        pid = self.child.pid
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return
        try:
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:[") and link not in self.seen:
                    self._arm(pidfd, int(fd), link[8:-1])
        finally:
            os.close(pidfd)

    def _arm(self, pidfd, fd, inode):
        libc = ctypes.CDLL(None, use_errno=True)
        dup = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if dup < 0:
            err = ctypes.get_errno()
            if err in (errno.EPERM, errno.ENOSYS, errno.EACCES):
                self.adoption = False
                log(f"cannot watch llama-server's connections ({os.strerror(err)}): a worker "
                    "that goes away silently is noticed at the next request instead")
            return
        s = socket.socket(fileno=dup)
        try:
            try:
                peer = s.getpeername()
            except OSError as exc:
                if exc.errno != errno.ENOTCONN or s.getsockopt(socket.SOL_SOCKET,
                                                               socket.SO_ACCEPTCONN):
                    self.seen.add(f"socket:[{inode}]")  # a listener, or no TCP at all
                return  # still connecting: armed at a later look
            self.seen.add(f"socket:[{inode}]")
            name = self.owner.get(f"{peer[0]}:{peer[1]}") if isinstance(peer, tuple) else None
            if name is None:
                return
            s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for opt, value in (("TCP_KEEPIDLE", KEEPIDLE), ("TCP_KEEPINTVL", KEEPINTVL),
                               ("TCP_KEEPCNT", KEEPCNT), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
                if hasattr(socket, opt):
                    s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
            self.armed[inode] = name
            self.local.setdefault(name, set()).add((s.getsockname(), f"{peer[0]}:{peer[1]}"))
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
        if self.child is None:
            return set()
        table = {}
        for name in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(name) as f:
                    for row in f.read().splitlines()[1:]:
                        w = row.split()
                        if len(w) > 9:
                            table[w[9]] = (w[3], w[2])
            except OSError:
                continue
        try:
            mine = {os.readlink(f"/proc/{self.child.pid}/fd/{fd}")[8:-1]
                    for fd in os.listdir(f"/proc/{self.child.pid}/fd")}
        except OSError:
            return set()
        for inode in [i for i in self.armed if i not in mine]:
            del self.armed[inode]  # closed by llama-server itself
        gone = {name for inode, name in self.armed.items() if table.get(inode, ("",))[0] != "01"}
        now = time.monotonic()
        for inode in [i for i in self.connecting if i not in mine or
                      table.get(i, ("",))[0] != "02"]:
            del self.connecting[inode]
        for inode in mine - set(self.armed):
            state, remote = table.get(inode, ("", ""))
            name = self.owner.get(_address(remote)) if state == "02" else None
            if name is None:
                continue
            since = self.connecting.setdefault(inode, now)
            if now - since > USER_TIMEOUT_MS / 1000:
                gone.add(name)
        return gone

    # --- in flight ----------------------------------------------------------------------------
    def _server_url_and_key(self):
        args = self.base
        value = {}
        for i, a in enumerate(args[:-1]):
            value.setdefault(a, args[i + 1])
        host = value.get("--host", "127.0.0.1")
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        key = None
        path = value.get("--api-key-file")
        if path:
            try:
                with open(path) as f:
                    key = f.readline().strip()
            except OSError:
                key = None
        return f"http://{host}:{value.get('--port', '8080')}", key

    def requests_processing(self):
        url, key = self._server_url_and_key()
        req = urllib.request.Request(url + "/metrics")
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                text = r.read(1 << 20).decode("utf-8", "replace")
        except (OSError, ValueError):
            return None
        for line in text.splitlines():
            if line.startswith("llamacpp:requests_processing"):
                try:
                    return float(line.split()[-1])
                except ValueError:
                    return None
        return None

    def drain(self):
        """Waits (at most DRAIN seconds) until llama-server processes no request."""
        deadline = time.monotonic() + DRAIN
        while time.monotonic() < deadline and not self.stopping:
            busy = self.requests_processing()
            if busy is None or busy == 0:
                return busy is not None
            time.sleep(0.5)
        return False

    # --- the loop -----------------------------------------------------------------------------
    def serve(self, placement, lost):
        """Runs llama-server on `placement` until it exits, a worker it uses is lost, or a
        lost worker is back. Returns ("exited", code), ("lost", names) or ("back", names)."""
        self.start(placement)
        self.state("serving", placement, lost)
        back_count = {n: 0 for n in lost}
        next_probe = time.monotonic() + self.opts.interval
        while not self.stopping:
            code = self.child.poll()
            if code is not None:
                self.release()
                return "exited", code
            self.adopt()
            gone = self.hung_up(min(1.0, self.opts.interval))
            if gone:
                return "lost", gone
            if lost and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self.opts.interval
                ok = self.answering(lost)
                for n in lost:
                    back_count[n] = back_count[n] + 1 if n in ok else 0
                back = {n for n, c in back_count.items() if c >= self.opts.settle}
                if back and self.placement_for(set(lost) - back) is not None:
                    return "back", back
        return "stop", None

    def run(self):
        lost_before = None
        while not self.stopping:
            # A worker just lost is not asked again: its HELLO would only time out.
            others = [n for n in self.workers if n not in self.just_lost]
            lost = set(self.just_lost) | (set(others) - self.answering(others))
            self.just_lost = set()
            for name in set(self.stale) - lost:
                del self.stale[name]  # it answered: nothing of the old connection is left
            placement = self.placement_for(lost)
            if placement is None:
                if lost != lost_before:
                    log(f"down while {', '.join(sorted(lost))} "
                        f"{'is' if len(lost) == 1 else 'are'} away: no placement without "
                        "them (see the plan's Failover lines)")
                lost_before = lost
                self.state("down", None, lost)
                time.sleep(self.opts.interval)
                continue
            lost_before = lost
            what, detail = self.serve(placement, lost)
            if what == "lost":
                self.just_lost = set(detail)
                for name in detail:
                    self.stale[name] = self.local.get(name, set())
                log(f"lost {', '.join(sorted(detail))}: its connection from llama-server failed")
                self.stop_child(f"{', '.join(sorted(detail))} away")
            elif what == "back":
                log(f"{', '.join(sorted(detail))} answers again: waiting for requests in flight")
                self.drain()
                self.stop_child(f"{', '.join(sorted(detail))} back")
            elif what == "exited":
                log(f"llama-server exited with status {detail}")
                self.child = None
                used = [n for n in self.workers if n not in lost]
                if self.stopping:
                    continue
                gone = set(used) - self.answering(used)
                if not gone:
                    # Not a worker's loss: the service manager restarts md-failover, as it would
                    # a llama-server that exits.
                    self.state("exited", placement, lost)
                    return detail if detail else 1
                self.just_lost = gone  # llama-server aborted on them before they were seen
                for name in gone:
                    self.stale[name] = self.local.get(name, set())
        self.stop_child("stopping")
        self.state("stopped")
        return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="md-failover.py")
    p.add_argument("--state", help="JSON file that says which placement runs (default: "
                   "$RUNTIME_DIRECTORY/failover.json where the service manager gives one)")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--settle", type=int, default=2)
    p.add_argument("--rpc-flag", default="--rpc")
    p.add_argument("--ts-flag", default="-ts")
    p.add_argument("--worker", action="append", default=[])
    p.add_argument("--placement", nargs=3, action="append", default=[],
                   metavar=("LOST", "RPC", "TS"))
    p.add_argument("argv", nargs="+")
    opts = p.parse_args(argv)
    sup = Supervisor(opts)

    def stop(signum, frame):
        sup.stopping = True
        if sup.child is not None and sup.child.poll() is None:
            sup.child.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
