"""Two network namespaces joined by a rate-limited veth pair, and a throwaway sshd in one of them.

For benchmarks/transport_cost.py: an orchestrator namespace and a worker namespace, addresses
that exist only inside them, `tc tbf` on both ends of the link (this kernel has no netem), and
an sshd with its own config, host key and authorized_keys in a temporary folder. Root only.
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
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.keep_log:
            shutil.copy(self.dir / "sshd.log", self.keep_log)
        shutil.rmtree(self.dir, ignore_errors=True)


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
