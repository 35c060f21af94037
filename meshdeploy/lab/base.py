"""The shared Debian root every lab host overlays, built once per recipe and cached.

One recipe per Debian release too (SUITES: 11 bullseye, 12 bookworm, 13 trixie; bookworm when
not named), so a lab can mix releases host by host (Lab(suites=...)).

Three recipes: the plain one (what SSH and systemd need: meshdeploy installs the rest), the
same with TOOLCHAIN added, a prepared build machine, for labs whose tests are not about
installing the build tools (each of its hosts saves the minute that toolchain.packages spends
in apt and dpkg), and that with USER_SERVICES added, for labs with hosts whose login user has no
root (lab/kinds.py: every host of such a lab, root ones too, boots from it)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from meshdeploy.lab import arches
from meshdeploy.lab.errors import INSTALL_HINT, LabError, per_host

SUITE = "bookworm"  # the release of a host whose lab names none
# The releases a lab host can run, all from the same mirror, and the packages a release does not
# have: Debian 11 has no wireguard-go (it came with 12), so its hosts cannot run userspace
# WireGuard (the lockdown work's tunnel is tried on bookworm hosts only).
SUITES = {"bullseye": "11", "bookworm": "12", "trixie": "13"}
MISSING = {"bullseye": ("wireguard-go",)}
MIRROR = "http://deb.debian.org/debian"
VARIANT = "minbase"
# What SSH and systemd need, plus the firewall and tunnel tools a real host has or gets from
# its distribution (the lockdown work runs nft and wireguard-go in hosts): toolchains, git and
# curl are the product's job to install.
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "iproute2",
    "sudo",
    "ca-certificates",
    "nftables",
    "wireguard-tools",
    # Userspace WireGuard over TUN: the machine's kernel has no WireGuard module.
    "wireguard-go",
)

# The build tools a prepared machine already has: the toolchain role's apt packages for a
# Debian host and ccache (inventories/lab.yaml turns it on). tests/labtool/test_lab_base.py keeps the
# list and the role's in step.
TOOLCHAIN = ("cmake", "g++", "git", "curl", "ninja-build", "ccache")

# What a host needs to run services for a user without root, both ways lab/kinds.py offers:
# runit (runsvdir, sv, svlogd: Termux's termux-services), and libpam-systemd with the session
# bus apt recommends beside it (sshd's PAM session registers with logind, which sets
# XDG_RUNTIME_DIR and starts the user's systemd --user). Its own recipe, so labs on the
# toolchain base keep their hosts as they were (no logind session on every root host's login).
USER_SERVICES = ("runit", "libpam-systemd", "dbus-user-session")
# Debian's system-wide runsvdir on /etc/service is runit.service, from runit-systemd (apt's
# recommendation beside runit, which debootstrap leaves out): masked all the same, so that in a
# lab host only a user's own runsvdir runs, whatever joins the recipe later.
# With pam_systemd every root login would start a user manager for root too (user@0), the lab's
# own readiness check and `run(root=True)` included; nothing here uses one, and a user manager
# stopped by a host's shutdown sometimes keeps nspawn waiting until `down` kills it (docs/lab.md),
# so root gets none (logind skips a masked user@UID.service).
USER_SERVICES_SETUP = r"""
ln -sf /dev/null /etc/systemd/system/runit.service
ln -sf /dev/null /etc/systemd/system/user@0.service
"""

# A root of another architecture runs under qemu-user (lab/arches.py), where systemd cannot set
# up a unit's credentials ("Failed to set up credentials: Invalid argument", status
# 243/CREDENTIALS: seen with systemd 252 under QEMU 7.2): the units that load some (the
# optional first-boot, sysctl and tmpfiles ones) would fail at every boot and leave the host
# degraded. Their LoadCredential= lines are emptied by a drop-in. And qemu-user carries
# netlink's routing protocol alone: no netfilter (nft: "Unable to initialize Netlink socket:
# Protocol not supported") and no sock_diag (ss falls back to /proc/net/tcp, which has no
# cgroup ids: meshdeploy's port-owner check refuses to go on without them). So such a host's
# nft, ip and ss are the machine's own architecture's (Debian's multiarch: nftables and
# iproute2 for amd64, which the kernel runs natively). Nothing else changes: units start
# sandboxed as on a real arm64 host, and every other binary is arm64.
EMULATED_SETUP = r"""
for unit in $(grep -l '^LoadCredential=' /lib/systemd/system/*.service); do
  mkdir -p "/etc/systemd/system/${unit##*/}.d"
  printf '[Service]\nLoadCredential=\n' > "/etc/systemd/system/${unit##*/}.d/lab-emulated.conf"
done
dpkg --add-architecture {native}
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    nftables:{native} iproute2:{native}
apt-get clean
rm -rf /var/lib/apt/lists/*
""".replace("{native}", arches.NATIVE)

# Runs inside the fresh root (chroot). Host identity (ssh host keys, machine-id) is removed so
# every host generates its own on first boot; keys for users are added per host, not here.
# SOURCES comes first, filled in per suite (every release since 11 names its security suite
# `<suite>-security` under debian-security).
SOURCES = r"""
set -eu
cat > /etc/apt/sources.list <<'EOF'
deb http://deb.debian.org/debian {suite} main
deb http://deb.debian.org/debian {suite}-updates main
deb http://deb.debian.org/debian-security {suite}-security main
EOF
"""
SETUP_SCRIPT = r"""
useradd --create-home --shell /bin/bash deploy
install -d -m 0700 -o deploy -g deploy /home/deploy/.ssh
install -d -m 0700 /root/.ssh
echo 'deploy ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/deploy
chmod 0440 /etc/sudoers.d/deploy
cat > /etc/ssh/sshd_config.d/lab.conf <<'EOF'
PasswordAuthentication no
PermitRootLogin prohibit-password
UseDNS no
# pyinfra opens several channels per connection when it gathers facts in parallel.
MaxSessions 64
MaxStartups 100:30:200
EOF
# Debian's ssh.service refuses to start without host keys; generate them on first boot.
cat > /etc/systemd/system/lab-ssh-hostkeys.service <<'EOF'
[Unit]
Description=Generate this host's SSH host keys
Before=ssh.service
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A

[Install]
WantedBy=multi-user.target
EOF
ln -sf /etc/systemd/system/lab-ssh-hostkeys.service \
    /etc/systemd/system/multi-user.target.wants/lab-ssh-hostkeys.service
ln -sf /lib/systemd/system/ssh.service /etc/systemd/system/multi-user.target.wants/ssh.service
# No console login in a lab host: it only costs memory and restarts.
ln -sf /dev/null /etc/systemd/system/console-getty.service
ln -sf /dev/null /etc/systemd/system/getty@.service
rm -f /etc/ssh/ssh_host_*
: > /etc/machine-id
rm -f /var/lib/dbus/machine-id
apt-get clean
rm -rf /var/lib/apt/lists/*
"""


def cache_root() -> Path:
    return Path(os.environ.get("MESHDEPLOY_LAB_CACHE", "/var/cache/meshdeploy/lab"))


def check_suite(suite: str) -> str:
    if suite not in SUITES:
        raise LabError(f"unknown Debian release {suite!r} for a lab host; one of "
                       + ", ".join(f"{name} ({number})" for name, number in SUITES.items()))
    return suite


def resolve_suites(chosen: dict[str, str] | None, host_names: list[str]) -> dict[str, str]:
    """The Debian release of every host (SUITE unless `chosen` names it), checked: known
    releases and hosts of the lab only."""
    return per_host(chosen, host_names, "host releases", check_suite, SUITE)


def recipe(toolchain: bool = False, user_services: bool = False, suite: str = SUITE,
           arch: str = arches.NATIVE) -> dict:
    """+ toolchain: with TOOLCHAIN
    + user_services: with TOOLCHAIN and USER_SERVICES (the hosts of lab/kinds.py)
    + suite: the Debian release (SUITES); bookworm's recipes are those from before suites
    + arch: the Debian architecture (lab/arches.py); the machine's own recipes are those from
      before architectures
    """
    missing = MISSING.get(check_suite(suite), ())
    packages = [p for p in PACKAGES if p not in missing]
    if toolchain or user_services:
        packages += TOOLCHAIN
    if user_services:
        packages += USER_SERVICES
    spec = {
        "suite": suite,
        "mirror": MIRROR,
        "variant": VARIANT,
        "packages": packages,
        "setup": setup_script(suite) + (USER_SERVICES_SETUP if user_services else ""),
    }
    if arches.check_arch(arch) != arches.NATIVE:
        spec["arch"] = arch
        spec["setup"] += EMULATED_SETUP
    return spec


def setup_script(suite: str = SUITE) -> str:
    """SETUP_SCRIPT for `suite`, its apt sources first (bookworm's is the script from before
    suites, character for character: its cached bases stay valid)."""
    return SOURCES.format(suite=suite) + SETUP_SCRIPT.lstrip("\n")


def recipe_hash(spec: dict | None = None) -> str:
    blob = json.dumps(spec or recipe(), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def base_dir(root: Path | None = None, spec: dict | None = None) -> Path:
    return (root or cache_root()) / f"base-{recipe_hash(spec)}"


def ensure_base(root: Path | None = None, log=print, toolchain: bool = False,
                user_services: bool = False, suite: str = SUITE,
                arch: str = arches.NATIVE) -> Path:
    """Return the rootfs of the cached base, debootstrapping it first when the recipe is new
    (`toolchain`, `user_services`, `suite`, `arch`: see recipe()).

    The build happens in a temporary directory renamed into place only when complete, so an
    interrupted build never leaves a base that looks usable.
    """
    root = root or cache_root()
    spec = recipe(toolchain, user_services, suite, arch)
    final = base_dir(root, spec)
    rootfs = final / "rootfs"
    if (final / "complete").exists():
        arches.confine(final, arch)  # a base cached before arm64 roots were root-only
        return rootfs
    if shutil.which("debootstrap") is None:
        raise LabError(f"debootstrap is missing: {INSTALL_HINT}")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "complete").exists():
            return rootfs
        arches.ensure(arch)  # debootstrap's second stage runs the new root's binaries
        _build(final, spec, log)
    return rootfs


def remove_tree(path: Path) -> None:
    """Remove a folder a base build left, never through a mount beneath it. A debootstrap killed
    in its second stage leaves the new root's /proc mounted (seen: a bullseye build's, found
    under its .tmp folder after a run), and a removal that walks into a mount deletes what is
    mounted there: the machine's own files, where it is a bind. Each mount under `path` is
    unmounted first (deepest first, lazily), and rm keeps to the folder's own file system, so a
    mount that would not go is skipped, not emptied."""
    if path.is_symlink():  # the link goes, never what it points at or what is mounted there
        path.unlink()
        return
    if not path.exists():
        return
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as info:
        points = [_unescape(line.split()[4]) for line in info]
    for point in sorted((p for p in points if p == real or p.startswith(real + "/")),
                        key=len, reverse=True):
        subprocess.run(["umount", "-l", "--", point], capture_output=True)
    subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], capture_output=True)


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _build(final: Path, spec: dict, log) -> None:
    # A folder of this process's own: a debootstrap left running by a killed earlier run (its
    # lock released with it) keeps writing into its folder, never into this one, and is never
    # renamed into place. Earlier runs' folders go first (the caller holds the base's lock).
    for stale in final.parent.glob(f"{final.name}.tmp*"):
        remove_tree(stale)
    tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    remove_tree(final)
    tmp_rootfs = tmp / "rootfs"
    tmp_rootfs.mkdir(parents=True)
    arches.confine(tmp, spec.get("arch", arches.NATIVE))
    started = time.monotonic()
    arch = spec.get("arch")
    log(f"building lab base {final.name} (debootstrap {spec['suite']}"
        f"{' ' + arch if arch else ''}, once per recipe)")
    argv = [
        "debootstrap",
        *([f"--arch={arch}"] if arch else []),
        f"--variant={VARIANT}",
        f"--include={','.join(spec['packages'])}",
        spec["suite"],
        str(tmp_rootfs),
        MIRROR,
    ]
    _run(argv, tmp / "debootstrap.log", "debootstrap")
    _run(["chroot", str(tmp_rootfs), "/bin/sh", "-c", spec["setup"]], tmp / "setup.log", "setup")
    (tmp / "recipe.json").write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
    (tmp / "complete").write_text(f"{time.monotonic() - started:.1f}\n")
    tmp.rename(final)
    log(f"lab base ready in {time.monotonic() - started:.0f} s: {final}")


def _run(argv: list[str], logfile: Path, what: str) -> None:
    with open(logfile, "w") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = logfile.read_text(errors="replace").strip().splitlines()[-5:]
        raise LabError(
            f"building the lab base failed in {what} (exit {proc.returncode}); "
            f"see {logfile}: {' | '.join(tail)}"
        )
