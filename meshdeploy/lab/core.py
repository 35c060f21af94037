"""The lab as a whole: `Lab(...).up()` brings hosts, network and mirrors up, `.down()` removes all.

`Lab(hosts=3, rogue=1)` adds node4 after node1..node3: a "rogue" host on the same bridge,
booted and reachable by the lab exactly like the others, that no cluster file names (tests use
it as the stranger that must not reach a worker's rpc-server).

`Lab(hosts=3, toolchain=True, kinds={"node2": "termux", "node3": "rootless-systemd"})` makes
node2 and node3 hosts whose login user has no root (lab/kinds.py); node1 stays a root host.

`Lab(hosts=3, suites={"node2": "bullseye", "node3": "trixie"})` boots node2 from Debian 11,
node3 from Debian 13 and node1 from Debian 12 (lab/base.py: one cached base per release).

`Lab(hosts=3, arches={"node3": "arm64"})` boots node3 from an arm64 Debian under qemu-user
(lab/arches.py: one cached base per release and architecture).

Everything `down` removes is found again from names (`<lab>`, `<lab>-<host>` namespaces), the
state directory (mounts below it, processes marked with it), never from this process's memory,
so it cleans up after a crashed or interrupted `up` just as well.

What `up` hands back and writes for its users (LabInfo and lab.json, the ssh_config):
lab/labinfo.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from meshdeploy.lab import arches as host_arches
from meshdeploy.lab import base, hosts, net, procs, services
from meshdeploy.lab import kinds as host_kinds
from meshdeploy.lab.errors import INSTALL_HINT, LabError
from meshdeploy.lab.labinfo import LabHost, LabInfo, render_ssh_config

DEFAULT_NAME = "mdlab"
STATE_ROOT = Path("/var/lib/meshdeploy/lab")
REQUIRED_TOOLS = ("debootstrap", "systemd-nspawn", "tinyproxy", "socat", "nc", "ip", "git",
                  "ssh", "ssh-keygen", "mount", "umount", "chroot", "nsenter")
INOTIFY = Path("/proc/sys/fs/inotify/max_user_instances")
# Each booted host's systemd holds a handful of inotify instances; the default 128 runs out
# at about 20 hosts, after which new hosts hang at boot.
INOTIFY_PER_HOST = 8


def check_environment() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (namespaces, mounts, systemd-nspawn): run it as root")
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        raise LabError(f"missing tools: {', '.join(missing)}: {INSTALL_HINT}")


class Lab:
    def __init__(self, name: str = DEFAULT_NAME, hosts: int = 3,
                 state_dir: str | Path | None = None, mirrors: bool = True, log=print,
                 rogue: int = 0, toolchain: bool = False, kinds: dict[str, str] | None = None,
                 suites: dict[str, str] | None = None, arches: dict[str, str] | None = None):
        """+ hosts: node1..nodeN, the hosts cluster files describe
        + rogue: that many more hosts after them (nodeN+1...), recorded in LabInfo.rogue
        + toolchain: hosts start with the build tools installed (base.TOOLCHAIN), as a
          prepared build machine has them; toolchain.packages then has nothing to install
        + kinds: host name -> kind (lab/kinds.py: root, rootless-systemd, termux); hosts it
          does not name are root hosts; kinds other than root need toolchain=True
        + suites: host name -> Debian release (base.SUITES: bullseye, bookworm, trixie); hosts
          it does not name run bookworm
        + arches: host name -> Debian architecture (arches.ARCHES: amd64, arm64); hosts it
          does not name run the machine's own (amd64)
        """
        self.name = net.check_name(name)
        if rogue < 0:
            raise LabError(f"--rogue must be 0 or more, got {rogue}")
        net.host_names(hosts)  # checks the cluster part alone, with its own message
        self.host_names = net.host_names(hosts + rogue)
        self.rogue_names = self.host_names[hosts:]
        self.state_dir = Path(state_dir) if state_dir else STATE_ROOT / name
        self.state_dir = self.state_dir.absolute()
        self.mirrors = mirrors
        self.toolchain = toolchain
        self.kinds = host_kinds.resolve(kinds, self.host_names, toolchain)
        self.user_services = host_kinds.user_services(self.kinds)
        self.suites = base.resolve_suites(suites, self.host_names)
        self.arches = host_arches.resolve(arches, self.host_names)
        self.log = log
        self.marker = str(self.state_dir)
        self.run_dir = self.state_dir / "run"
        self.ssh_config = self.state_dir / "ssh_config"
        self.key = self.state_dir / "id_ed25519"
        # root's key on hosts of the md kinds: the product, given the lab key, cannot be root
        self.admin_key = self.state_dir / "id_ed25519_admin"
        self.touched = False  # up() got past its checks and may have started things

    # -- up -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self):
        """Serialise up/down of one lab across processes (the lock file outlives `down`)."""
        self.state_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir.parent / f".{self.state_dir.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def up(self, timeout: float | None = None) -> LabInfo:
        check_environment()
        with self.locked():
            return self._up(timeout)

    def _up(self, timeout: float | None) -> LabInfo:
        self.touched = True
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(exist_ok=True)
        self._ensure_key(self.key)
        self._ensure_key(self.admin_key)
        rootfs = self._bases()
        for arch in sorted(set(self.arches.values())):
            host_arches.ensure(arch)  # registered again after the machine's reboot
        self._same_base(self._base_hash())
        self._same_kinds()
        cache = base.cache_root()
        ccache = cache / "ccache"
        ccache.mkdir(parents=True, exist_ok=True)
        ccache.chmod(0o1777)  # any build user in any host writes the shared cache
        if self.user_services:
            shared_ccache(ccache)

        net.ensure_lab_netns(self.name)
        mirrors = {"apt_proxy": services.start_proxy(self.name, self.run_dir, self.marker)}
        if self.mirrors:
            mirrors.update(services.start_git(self.name, self.run_dir, self.marker, cache))
            mirrors.update(services.start_hf(self.name, self.run_dir, self.marker, cache))

        self._stop_extra_hosts()
        self._raise_inotify(len(self.host_names))
        self._write_ssh_config()
        pubkey = self.key.with_suffix(".pub").read_text()
        admin_pubkey = self.admin_key.with_suffix(".pub").read_text()
        for h in self.host_names:
            if hosts.is_booted(self.state_dir, h, self.marker):
                continue
            ns = net.host_netns(self.name, h)
            if ns in net.list_netns():
                # Left by a crashed or interrupted run: start this host from a clean root.
                self._remove_hosts([ns])
            net.ensure_host_netns(self.name, h)
            hosts.prepare(self.state_dir, h, rootfs[self._root_of(h)], self.host_names, pubkey,
                          self.kinds[h], admin_pubkey)
            host_arches.confine(hosts.host_dir(self.state_dir, h), self.arches[h])
            hosts.boot(self.name, self.state_dir, h, ccache, self.marker)
        emulated = sum(a != host_arches.NATIVE for a in self.arches.values())
        wait = timeout or 60 + 4 * len(self.host_names) + host_arches.BOOT_EXTRA * emulated
        hosts.wait_ready(self.state_dir, self.host_names, self.ssh_config, self.marker, wait,
                         self.admin_key)

        info = LabInfo(
            name=self.name,
            state_dir=str(self.state_dir),
            bridge_address=net.BRIDGE_ADDRESS,
            hosts=[LabHost(h, net.host_address(h), net.host_netns(self.name, h), self.kinds[h],
                           host_kinds.KINDS[self.kinds[h]].user,
                           host_kinds.KINDS[self.kinds[h]].port, self.suites[h], self.arches[h])
                   for h in self.host_names],
            ssh={"user": "deploy", "key": str(self.key), "config": str(self.ssh_config),
                 "admin_key": str(self.admin_key)},
            mirrors=mirrors,
            rogue=list(self.rogue_names),
            base=self._base_hash(),
        )
        tmp = self.state_dir / "lab.json.tmp"
        tmp.write_text(json.dumps(info.to_dict(), indent=2, default=str) + "\n")
        tmp.replace(self.state_dir / "lab.json")
        return info

    def _root_of(self, host: str) -> tuple[str, str]:
        return self.suites[host], self.arches[host]

    def _bases(self) -> dict[tuple[str, str], Path]:
        """The root of each release and architecture the hosts run ((suite, arch) -> rootfs),
        each debootstrapped once and cached. New ones are built side by side: debootstrap
        mostly waits on the mirror and dpkg (measured: bullseye and trixie 117 s together,
        against 96 + 117 s in turn)."""
        roots = sorted({self._root_of(h) for h in self.host_names})
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(roots)) as pool:
            built = {(suite, arch): pool.submit(base.ensure_base, log=self.log, suite=suite,
                                                toolchain=self.toolchain,
                                                user_services=self.user_services, arch=arch)
                     for suite, arch in roots}
        return {root: future.result() for root, future in built.items()}

    def _base_hash(self) -> str:
        return base.recipe_hash(base.recipe(self.toolchain, self.user_services))

    def _same_kinds(self) -> None:
        """A running host keeps the kind, release and architecture it booted as: refuse to
        change them."""
        described = self.state_dir / "lab.json"
        if not described.exists():
            return
        had = {h.get("name"): (h.get("kind", host_kinds.ROOT), h.get("suite", base.SUITE),
                               h.get("arch", host_arches.NATIVE))
               for h in json.loads(described.read_text()).get("hosts", [])}
        wanted = {h: (self.kinds[h], *self._root_of(h)) for h in self.host_names}
        changed = [_differs(h, had[h], wanted[h])
                   for h in self.host_names
                   if h in had and had[h] != wanted[h]
                   and hosts.is_booted(self.state_dir, h, self.marker)]
        if changed:
            raise LabError(f"lab {self.name} runs hosts of other kinds or releases ({'; '.join(changed)}): "
                           f"`meshdeploy lab down --name {self.name}` first")

    def _same_base(self, wanted: str) -> None:
        """Hosts already running keep the root they booted from: refuse to call a lab of the
        plain base one with the toolchain (or the reverse) instead of quietly mixing them."""
        described = self.state_dir / "lab.json"
        if not described.exists():
            return
        had = json.loads(described.read_text()).get("base", "")
        running = [h for h in self.host_names
                   if hosts.is_booted(self.state_dir, h, self.marker)]
        if had and had != wanted and running:
            raise LabError(f"lab {self.name} runs on base {had} ({', '.join(running)}), not "
                           f"{wanted}: `meshdeploy lab down --name {self.name}` first")

    def _ensure_key(self, key: Path) -> None:
        if key.exists() and key.with_suffix(".pub").exists():
            return
        key.unlink(missing_ok=True)
        comment = f"meshdeploy-lab-{self.name}" + ("-admin" if key == self.admin_key else "")
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)],
            check=True, stdin=subprocess.DEVNULL,
        )

    def _write_ssh_config(self) -> None:
        self.ssh_config.write_text(render_ssh_config(self.name, self.host_names, self.key,
                                                     self.kinds))

    def _stop_extra_hosts(self) -> None:
        wanted = {net.host_netns(self.name, h) for h in self.host_names}
        extra = [ns for ns in net.lab_netns_names(self.name)
                 if ns != self.name and ns not in wanted]
        if extra:
            self._remove_hosts(extra)

    def _raise_inotify(self, count: int) -> None:
        needed = 64 + INOTIFY_PER_HOST * count
        current = int(INOTIFY.read_text())
        if current >= needed:
            return
        saved = self.state_dir / "inotify.orig"
        if not saved.exists():
            saved.write_text(f"{current}\n")
        INOTIFY.write_text(f"{max(needed, 1024)}\n")

    # -- down -----------------------------------------------------------------------------

    def down(self) -> float:
        """Remove the lab's hosts, namespaces, mounts and processes (the key pairs and ssh_config
        stay in its state folder for the next lab of that name); safe to repeat. Returns the
        seconds it took."""
        if os.geteuid() != 0:
            raise LabError("taking the lab down needs root: run it as root")
        with self.locked():
            return self._down()

    def _down(self) -> float:
        started = time.monotonic()
        host_ns = [ns for ns in net.lab_netns_names(self.name) if ns != self.name]
        self._remove_hosts(host_ns)
        leftover = procs.kill_all(procs.pids_marked(self.marker) + self._lab_ns_pids())
        for point in hosts.mounts_under(self.state_dir):
            _umount(point)
        for ns in net.lab_netns_names(self.name):
            net.delete_netns(ns)
        self._restore_inotify()
        for p in ("hosts", "run"):
            shutil.rmtree(self.state_dir / p, ignore_errors=True)
        for p in ("lab.json", "lab.json.tmp"):
            (self.state_dir / p).unlink(missing_ok=True)
        if leftover:
            raise LabError(f"processes survived SIGKILL: {leftover}; check `ps -p "
                           f"{','.join(map(str, leftover))}`")
        return time.monotonic() - started

    def _lab_ns_pids(self) -> list[int]:
        return net.netns_pids(self.name) if self.name in net.list_netns() else []

    def _remove_hosts(self, namespaces: list[str]) -> None:
        # Ask every host to power off first (nspawn turns SIGTERM into a clean shutdown), then
        # wait for all of them together: 24 hosts take as long as one.
        for ns in namespaces:
            h = ns[len(self.name) + 1:]
            d = hosts.host_dir(self.state_dir, h)
            if d.exists():
                (d / "stop").touch()
        pids = {ns: net.netns_pids(ns) for ns in namespaces}
        everything = [p for ps in pids.values() for p in ps]
        nspawns = [p for p in everything if _comm(p) == "systemd-nspawn"]
        procs.kill_all(nspawns, grace=10.0)
        leftover = procs.kill_all([p for ns in namespaces for p in net.netns_pids(ns)], grace=2.0)
        if leftover:
            raise LabError(f"processes in lab hosts survived SIGKILL: {leftover}")
        for ns in namespaces:
            h = ns[len(self.name) + 1:]
            for point in hosts.mounts_under(hosts.host_dir(self.state_dir, h)):
                _umount(point)
            net.delete_netns(ns)
            shutil.rmtree(hosts.host_dir(self.state_dir, h), ignore_errors=True)

    def _restore_inotify(self) -> None:
        saved = self.state_dir / "inotify.orig"
        if saved.exists():
            INOTIFY.write_text(saved.read_text())
            saved.unlink()

    # -- status ---------------------------------------------------------------------------

    def status(self) -> list[dict]:
        """One row per host namespace found (whether or not lab.json still exists)."""
        ports = self._described_ports()
        rows = []
        for ns in sorted(net.lab_netns_names(self.name), key=_natural):
            if ns == self.name:
                continue
            h = ns[len(self.name) + 1:]
            pids = net.netns_pids(ns)
            ssh_ok = subprocess.run(
                ["ip", "netns", "exec", ns, "nc", "-z", "-w", "1", "127.0.0.1",
                 str(ports.get(h, 22))],
                capture_output=True,
            ).returncode == 0
            rows.append({
                "host": h,
                "address": net.host_address(h) if h.removeprefix("node").isdigit() else "?",
                "netns": ns,
                "running": hosts.is_booted(self.state_dir, h, self.marker),
                "ssh": ssh_ok,
                "processes": len(pids),
                "pss_mib": round(hosts.pss_kib(pids) / 1024, 1),
            })
        return rows

    def _described_ports(self) -> dict[str, int]:
        """Each host's sshd port as lab.json has it; {} without a readable lab.json."""
        try:
            return {h.name: h.port for h in LabInfo.load(self.state_dir).hosts}
        except LabError:
            return {}


def leftovers(name: str, state_dir: Path | None = None) -> dict:
    """Traces of lab `name` on the machine: empty lists everywhere once it is really down."""
    state_dir = Path(state_dir or STATE_ROOT / name)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    addrs = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    subnet = str(net.SUBNET.network_address).rsplit(".", 1)[0] + "."
    netns_files = {f"/run/netns/{ns}" for ns in net.lab_netns_names(name)}
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    mounts = [p for p in points
              if p == str(state_dir) or p.startswith(f"{state_dir}/") or p in netns_files
              or p == f"/run/netns/{name}" or p.startswith(f"/run/netns/{name}-")]
    procs_left = [
        f"{pid} {procs.cmdline(pid)[:80]}"
        for pid in procs.pids_marked(str(state_dir))
    ]
    return {
        "netns": net.lab_netns_names(name),
        "mounts": mounts,
        "interfaces": [i for i in (ln.split(":")[1].strip() for ln in links.splitlines())
                       if i.startswith(name)],
        # A lab address or route in the machine's own namespace would be a leak, lab up or not.
        "root_ns_addresses": [ln for ln in (addrs + routes).splitlines() if subnet in ln],
        "processes": procs_left,
    }


def shared_ccache(folder: Path) -> None:
    """Let every build user of the lab's hosts (root, and md on hosts without root) write the
    shared ccache: entries made from now on are world-writable (ccache.conf umask), and those
    made before are opened up once. Only the lab's own cache; a real host's is the user's."""
    conf = folder / "ccache.conf"
    lines = conf.read_text().splitlines() if conf.exists() else []
    if "umask = 000" not in lines:
        conf.write_text("\n".join([line for line in lines if not line.startswith("umask")]
                                  + ["umask = 000"]) + "\n")
        for top, dirs, files in os.walk(folder):
            for name in dirs:
                os.chmod(os.path.join(top, name), 0o777)
            for name in files:
                os.chmod(os.path.join(top, name), 0o666)
    conf.chmod(0o644)


def _differs(host: str, had: tuple[str, ...], wanted: tuple[str, ...]) -> str:
    """`node2 is termux, not root` (kinds), `node2 is bullseye, not trixie` (releases),
    `node2 is arm64, not amd64` (architectures)."""
    pairs = [(a, b) for a, b in zip(had, wanted) if a != b]
    return (f"{host} is {' '.join(a for a, _ in pairs)}, "
            f"not {' '.join(b for _, b in pairs)}")


def _natural(ns: str):
    head = ns.rstrip("0123456789")
    tail = ns[len(head):]
    return (head, int(tail) if tail else -1)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _umount(point: str) -> None:
    if subprocess.run(["umount", point], capture_output=True).returncode != 0:
        # Busy because something still has it open: detach it now, the kernel frees it later.
        subprocess.run(["umount", "-l", point], capture_output=True)
