"""Two network namespaces joined by a rate-limited veth pair, a throwaway sshd in one of them and
a wireguard-go tunnel between them.

For benchmarks/transport_cost.py: an orchestrator namespace and a worker namespace, addresses
that exist only inside them, `tc tbf` on both ends of the link (this kernel has no netem), an
sshd with its own config, host key and authorized_keys in a temporary folder, and wireguard-go
(userspace, over TUN: this kernel has no WireGuard module) on both ends of the veth pair with
a subnet of its own. Root only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ORCH_ADDR, WORKER_ADDR = "10.231.0.1", "10.231.0.2"
WG_ORCH_ADDR, WG_WORKER_ADDR, WG_PORT = "10.232.0.1", "10.232.0.2", 51820


def run(*argv: str, ns: str | None = None, check: bool = True) -> str:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(argv)
    proc = subprocess.run(full, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(full)}` failed: {proc.stderr.strip()}")
    return proc.stdout


class Pair:
    """Namespaces `<tag>o` (orchestrator, ORCH_ADDR) and `<tag>w` (worker, WORKER_ADDR) joined by
    a veth pair shaped to `rate` both ways; rate "loopback": one namespace, WORKER_ADDR on its
    lo, orchestrator and worker talk over loopback (unshaped)."""

    def __init__(self, rate: str, tag: str = f"tc{os.getpid()}"):
        self.rate, self.loopback = rate, rate == "loopback"
        self.worker = f"{tag}w"
        self.orch = self.worker if self.loopback else f"{tag}o"
        self.client_addr = WORKER_ADDR if self.loopback else ORCH_ADDR
        self.dev = {self.orch: f"{tag}o-v", self.worker: f"{tag}w-v"}

    def __enter__(self) -> "Pair":
        for ns in dict.fromkeys((self.orch, self.worker)):
            run("ip", "netns", "add", ns)
        try:
            if self.loopback:
                run("ip", "addr", "add", f"{WORKER_ADDR}/32", "dev", "lo", ns=self.worker)
                run("ip", "link", "set", "lo", "up", ns=self.worker)
                return self
            run("ip", "link", "add", self.dev[self.orch], "type", "veth", "peer", "name",
                self.dev[self.worker])
            for ns, addr in ((self.orch, ORCH_ADDR), (self.worker, WORKER_ADDR)):
                run("ip", "link", "set", self.dev[ns], "netns", ns)
                run("ip", "addr", "add", f"{addr}/24", "dev", self.dev[ns], ns=ns)
                run("ip", "link", "set", "lo", "up", ns=ns)
                run("ip", "link", "set", self.dev[ns], "up", ns=ns)
                run("tc", "qdisc", "add", "dev", self.dev[ns], "root", "tbf", "rate", self.rate,
                    "burst", "256kb", "latency", "50ms", ns=ns)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in dict.fromkeys((self.orch, self.worker)):
            run("ip", "netns", "del", ns, check=False)   # takes the veth pair with it

    def link_bytes(self) -> int:
        """Bytes sent over the link both ways (loopback: everything sent on the namespace's
        lo, where a forwarded byte is counted on each leg it crosses)."""
        if self.loopback:
            return _tx(self.worker, "lo")
        return _tx(self.orch, self.dev[self.orch]) + _tx(self.worker, self.dev[self.worker])


def _tx(ns: str, dev: str) -> int:
    doc = json.loads(run("ip", "-s", "-j", "link", "show", dev, ns=ns))
    return int(doc[0]["stats64"]["tx"]["bytes"])


def wait_listening(ns: str, port: int, timeout: float = 20.0,
                   stop_if: subprocess.Popen | None = None) -> None:
    """Until something listens on TCP `port` in `ns` (no connection made: rpc-server serves
    one client at a time and a probe would be that client); fails early if `stop_if` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run("ss", "-Hltn", f"sport = :{port}", ns=ns).strip():
            return
        if stop_if is not None and stop_if.poll() is not None:
            raise RuntimeError(f"exited {stop_if.returncode} before port {port} listened")
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} in {ns} after {timeout:.0f} s")


class Sshd:
    """An sshd (Debian 12's, OpenSSH 9.2) in the worker namespace, keys and config in a
    temporary folder. This machine has no `sshd` privsep user and no /run/sshd: sshd runs in a
    private mount namespace with a passwd file that has one (an overlay on /etc) and a tmpfs
    on /run."""

    def __init__(self, pair: Pair, binary: str, options: dict[str, str], key_options: str,
                 keep_log: Path | None = None):
        self.pair, self.binary, self.options, self.key_options = pair, binary, options, key_options
        self.keep_log = keep_log
        self.dir = Path(tempfile.mkdtemp(prefix="meshdeploy-sshd-"))
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Sshd":
        d = self.dir
        for name in ("host", "client"):
            run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(d / name))
        users = [line for line in Path("/etc/passwd").read_text().splitlines()
                 if not line.startswith("sshd:")]
        (d / "passwd").write_text("\n".join(users + [
            "sshd:x:991:65534:sshd privsep:/run/sshd:/usr/sbin/nologin"]) + "\n")
        (d / "authorized_keys").write_text(
            f"{self.key_options} {(d / 'client.pub').read_text()}")
        (d / "known_hosts").write_text(
            WORKER_ADDR + " " + " ".join((d / "host.pub").read_text().split()[:2]) + "\n")
        config = {"ListenAddress": f"{WORKER_ADDR}:22", "HostKey": str(d / "host"),
                  "AuthorizedKeysFile": str(d / "authorized_keys"), "StrictModes": "no",
                  "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no",
                  "PermitRootLogin": "prohibit-password", "UsePAM": "no", "UseDNS": "no",
                  "PidFile": "none", **self.options}
        (d / "sshd_config").write_text("".join(f"{k} {v}\n" for k, v in config.items()))
        # An overlay on /etc, not a bind mount on /etc/passwd: a rename over /etc/passwd on
        # the machine (useradd elsewhere) detaches a file mount in other namespaces, and
        # sshd's next connection then finds no privsep user.
        (d / "etc").mkdir()
        (d / "passwd").rename(d / "etc" / "passwd")
        (d / "etc-work").mkdir()
        inner = (f"mount --make-rprivate / && mount -t overlay overlay -o lowerdir=/etc,"
                 f"upperdir={d}/etc,workdir={d}/etc-work /etc && "
                 f"mount -t tmpfs tmpfs /run && mkdir -m 755 /run/sshd && "
                 f"exec {self.binary} -D -e -f {d}/sshd_config")
        self.log = open(d / "sshd.log", "w")
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.pair.worker, "unshare", "-m",
                                      "sh", "-c", inner], stdout=self.log, stderr=self.log)
        wait_listening(self.pair.worker, 22)
        return self

    def client_argv(self, *extra: str) -> list[str]:
        """ssh with this sshd's key and pinned host key, no user config; `extra` before the
        destination."""
        d = self.dir
        return ["ssh", "-F", "none", "-i", str(d / "client"), "-o", "IdentitiesOnly=yes",
                "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={d}/known_hosts",
                "-o", "StrictHostKeyChecking=yes", *extra, f"root@{WORKER_ADDR}"]

    def __exit__(self, *exc) -> None:
        # Connection processes outlive the listener (and the namespace) until their client
        # goes or ClientAlive gives up: end them by pid too.
        for pid in descendants(self.proc.pid)[1:] if self.proc else []:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        stop(self.proc)
        self.log.close()
        if self.keep_log:
            shutil.copy(self.dir / "sshd.log", self.keep_log)
        shutil.rmtree(self.dir, ignore_errors=True)


class Wireguard:
    """wireguard-go in both namespaces of a veth `pair`: interface `<tag>o-wg` (WG_ORCH_ADDR) and
    `<tag>w-wg` (WG_WORKER_ADDR) in 10.232.0.0/24, each the other's only peer (endpoint: the
    peer's veth address, UDP WG_PORT; allowed-ips: the peer's tunnel address). MTU 1420 and no
    persistent keepalive, as wg-quick sets up meshdeploy's `network.transport: wireguard`.
    `procs` are the two wireguard-go processes (run in the foreground, so their pids are the
    daemons')."""

    def __init__(self, pair: Pair, binary: str = "wireguard-go"):
        if pair.loopback:
            raise ValueError("wireguard needs the veth pair (a --rate), not loopback")
        self.pair, self.binary = pair, binary
        self.dir = Path(tempfile.mkdtemp(prefix="meshdeploy-wg-"))
        self.dev = {ns: f"{dev[:-2]}-wg" for ns, dev in pair.dev.items()}
        self.procs: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "Wireguard":
        try:
            self._up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _up(self) -> None:
        p, d = self.pair, self.dir
        ends = {p.orch: (WG_ORCH_ADDR, ORCH_ADDR), p.worker: (WG_WORKER_ADDR, WORKER_ADDR)}
        keys = {}
        for ns in ends:
            key = run("wg", "genkey").strip()
            (d / ns).write_text(key + "\n")
            os.chmod(d / ns, 0o600)
            keys[ns] = subprocess.run(["wg", "pubkey"], input=key, capture_output=True,
                                      text=True, check=True).stdout.strip()
        for ns, (tunnel_addr, _) in ends.items():
            dev = self.dev[ns]
            # WG_PROCESS_FOREGROUND: no daemon fork (the pid stays the one to count CPU of)
            # and no "use the kernel module" banner.
            with open(d / f"{ns}.log", "w") as log:
                self.procs[ns] = subprocess.Popen(
                    ["ip", "netns", "exec", ns, self.binary, "-f", dev],
                    stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                    env={**os.environ, "WG_PROCESS_FOREGROUND": "1", "LOG_LEVEL": "error"})
            _wait_for(lambda: Path(f"/var/run/wireguard/{dev}.sock").exists(),
                      f"wireguard-go's {dev}.sock", self.procs[ns])
            peer = next(n for n in ends if n != ns)
            run("wg", "set", dev, "listen-port", str(WG_PORT), "private-key", str(d / ns),
                "peer", keys[peer], "endpoint", f"{ends[peer][1]}:{WG_PORT}",
                "allowed-ips", f"{ends[peer][0]}/32", ns=ns)
            run("ip", "addr", "add", f"{tunnel_addr}/24", "dev", dev, ns=ns)
            run("ip", "link", "set", dev, "mtu", "1420", "up", ns=ns)

    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs.values()]

    def handshaken(self, within: float = 100.0) -> bool:
        """Whether the orchestrator's end completed a handshake in the last `within` seconds
        (WireGuard rekeys after 120 s; a session that old makes the next packet wait)."""
        out = run("wg", "show", self.dev[self.pair.orch], "latest-handshakes", ns=self.pair.orch)
        latest = max((int(line.split()[1]) for line in out.splitlines() if line.strip()),
                     default=0)
        return time.time() - latest < within

    def __exit__(self, *exc) -> None:
        # `ip netns exec` execs wireguard-go: the Popen pid is the daemon's. SIGTERM makes it
        # remove its TUN device and UAPI socket.
        for proc in self.procs.values():
            stop(proc)
        for dev in self.dev.values():
            Path(f"/var/run/wireguard/{dev}.sock").unlink(missing_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _wait_for(ready, what: str, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode} before {what} appeared")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} after {timeout:.0f} s")
        time.sleep(0.05)


def stop(proc: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 10 s; nothing if it is gone or was never started."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def descendants(pid: int) -> list[int]:
    """pid and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        todo.extend(int(k) for k in kids)
    return out


def cpu_seconds(pids) -> dict[int, float]:
    """{pid: utime + stime in seconds} from /proc/<pid>/stat (gone processes left out)."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[pid] = (int(fields[11]) + int(fields[12])) / hz
    return out
