"""One lab host: an overlay root over the shared base, booted by systemd-nspawn in its netns."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from meshdeploy.lab import kinds, net, procs
from meshdeploy.lab.errors import LabError

CCACHE_IN_HOST = "/var/cache/meshdeploy-ccache"
NSPAWN_REBOOT_EXIT = 133
# What a real host can do for a firewall and a tunnel (nft, `ip tuntap`, wireguard-go): nspawn
# drops CAP_NET_ADMIN unless it sets up the network itself, and ours comes from `nsenter --net=`.
# It acts on the host's own namespace only. Measured with nspawn 252: /dev/net/tun is already
# there (nspawn creates it in every container), so no --bind; and no
# `--property=DeviceAllow=/dev/net/tun rwm`, which without registration nspawn ignores
# ("--property= settings will have no effect").
NET_ADMIN_FLAGS = ("--capability=CAP_NET_ADMIN",)


def host_dir(state_dir: Path, host: str) -> Path:
    return state_dir / "hosts" / host


def overlay_mounted(root: Path) -> bool:
    return str(root) in mounts_under(root.parent)


def mounts_under(prefix: Path) -> list[str]:
    """Mount points at or below `prefix`, deepest first (the order to unmount them)."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == str(prefix) or point.startswith(str(prefix) + "/"):
                points.append(point)
    return sorted(set(points), key=len, reverse=True)


def prepare(state_dir: Path, host: str, base_rootfs: Path, all_hosts: list[str], pubkey: str,
            kind: str = kinds.ROOT, admin_pubkey: str | None = None):
    """Mount the host's overlay root and write what makes it this host, of kind `kind`, and
    reachable by key: `pubkey` logs in as the kind's user, and as root on a root host; on the
    other kinds only `admin_pubkey` logs in as root."""
    d = host_dir(state_dir, host)
    upper, work, root = d / "upper", d / "work", d / "root"
    for p in (upper, work, root):
        p.mkdir(parents=True, exist_ok=True)
    if not overlay_mounted(root):
        opts = f"lowerdir={base_rootfs},upperdir={upper},workdir={work}"
        proc = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, str(root)],
            capture_output=True, text=True,
        )
        if proc.returncode != 0:
            raise LabError(f"mounting the overlay root of {host} failed: {proc.stderr.strip()}")
    (root / "etc/hostname").write_text(host + "\n")
    lines = ["127.0.0.1 localhost", f"127.0.1.1 {host}", f"{net.BRIDGE_ADDRESS} lab-gateway"]
    lines += [f"{net.host_address(h)} {h}" for h in all_hosts]
    (root / "etc/hosts").write_text("\n".join(lines) + "\n")
    kinds.apply(root, kind)
    spec = kinds.KINDS[kind]
    root_keys = [pubkey] if spec.has_root else [admin_pubkey] if admin_pubkey else []
    uid, gid, home = _account(root, spec.user)
    for path, owner, keys in ((root / home.lstrip("/"), (uid, gid), [pubkey]),
                              (root / "root", (0, 0), root_keys)):
        _authorize(path, owner, keys)
    (d / "stop").unlink(missing_ok=True)
    return root


def _authorize(home: Path, owner: tuple[int, int], keys: list[str]) -> None:
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700, exist_ok=True)
    authorized = ssh / "authorized_keys"
    authorized.write_text("".join(k.strip() + "\n" for k in keys))
    for p in (ssh, authorized):
        os.chown(p, *owner)
    authorized.chmod(0o600)


def _account(root: Path, user: str) -> tuple[int, int, str]:
    """`user`'s uid, gid and home directory in the host's /etc/passwd."""
    for line in (root / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if fields[0] == user:
            return int(fields[2]), int(fields[3]), fields[5]
    raise LabError(f"the lab base has no user {user!r}; delete the base cache to rebuild it")


def boot(lab: str, state_dir: Path, host: str, ccache: Path, marker: str) -> int:
    """Start the host's nspawn in a restart loop (a reboot inside makes nspawn exit 133)."""
    d = host_dir(state_dir, host)
    nspawn = shlex.join(
        [
            "systemd-nspawn",
            "--boot",
            "--register=no",  # no machined on the machine
            "--keep-unit",  # no systemd on the machine to create a scope
            f"--machine={host}",
            f"--directory={d / 'root'}",
            f"--bind={ccache}:{CCACHE_IN_HOST}",
            "--resolv-conf=off",
            "--timezone=off",
            "--link-journal=no",
            "--console=read-only",
            *NET_ADMIN_FLAGS,
            # nspawn's own seccomp filter refuses pidfd_getfd, which md-failover takes
            # llama-server's connections with (a host that is a machine of its own allows it).
            "--system-call-filter=pidfd_getfd",
        ]
    )
    stop = shlex.quote(str(d / "stop"))
    loop = (
        f"while :; do {nspawn}; rc=$?; "
        f'if [ "$rc" -ne {NSPAWN_REBOOT_EXIT} ] || [ -e {stop} ]; then exit "$rc"; fi; done'
    )
    ns = net.host_netns(lab, host)
    # Not `ip netns exec`: it remounts /sys, hiding the cgroup mounts nspawn needs.
    return procs.spawn(["nsenter", f"--net=/run/netns/{ns}", "sh", "-c", loop], d, "nspawn",
                       marker)


def is_booted(state_dir: Path, host: str, marker: str) -> bool:
    return procs.running(host_dir(state_dir, host), "nspawn", marker) is not None


def ssh_argv(ssh_config: Path, host: str, command: str, timeout: int = 5,
             identity: Path | None = None) -> list[str]:
    """+ identity: a key to offer besides the ssh_config's (the lab's admin key, for root)"""
    extra = ["-i", str(identity)] if identity else []
    return ["ssh", "-F", str(ssh_config), "-o", "BatchMode=yes", "-o",
            f"ConnectTimeout={timeout}", *extra, host, command]


# Run as root in each host: ready means boot finished with nothing failed. On this machine a
# unit sometimes fails to join its cgroup at boot (exit 219/CGROUP); restarting it heals that.
# Left failed, systemd-user-sessions keeps /run/nologin, which locks out every user but root.
READY_SCRIPT = """
state=$(systemctl is-system-running --wait 2>/dev/null)
if [ "$state" = degraded ]; then
    failed=$(systemctl list-units --failed --plain --no-legend | awk '{print $1}')
    systemctl reset-failed
    systemctl restart $failed
    state=$(systemctl is-system-running --wait 2>/dev/null)
fi
echo "$state $(systemctl list-units --failed --plain --no-legend | awk '{print $1}' | xargs)"
[ "$state" = running ]
"""
ATTEMPT_SECONDS = 45


def run_ssh(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run ssh, killing it together with its ProxyCommand when it overruns.

    ssh's ConnectTimeout does not cover a ProxyCommand connection whose server went silent, and
    nc outlives a killed ssh unless its whole process group goes.
    """
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def wait_ready(state_dir: Path, hosts: list[str], ssh_config: Path, marker: str,
               timeout: float, identity: Path | None = None) -> None:
    """Poll every host until it answers SSH with its boot finished; fail naming the laggards.

    + identity: the lab's admin key, which root takes on hosts of kinds other than root
    """
    pending = {h: "no answer" for h in hosts}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        tries = {
            h: subprocess.Popen(
                ssh_argv(ssh_config, f"root@{h}", READY_SCRIPT, 3, identity),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, start_new_session=True,
            )
            for h in sorted(pending)
        }
        round_end = min(deadline, time.monotonic() + ATTEMPT_SECONDS)
        for h, p in tries.items():
            try:
                out, _ = p.communicate(timeout=max(0.1, round_end - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(p)
                pending[h] = "SSH did not answer in time"
                continue
            if p.returncode == 0:
                del pending[h]
            elif not is_booted(state_dir, h, marker):
                log = host_dir(state_dir, h) / "nspawn.log"
                raise LabError(f"host {h} stopped while booting; see {log}")
            elif out.strip():
                pending[h] = "state " + out.strip()
        if pending:
            time.sleep(0.5)
    if pending:
        names = sorted(pending, key=lambda n: int(n.removeprefix("node")))
        detail = "; ".join(f"{h}: {pending[h]}" for h in names)
        raise LabError(
            f"hosts not ready after {timeout:.0f} s: {detail}; see their boot logs, e.g. "
            f"{host_dir(state_dir, names[0]) / 'nspawn.log'}"
        )


def pss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except (OSError, ValueError):
            continue
    return total
