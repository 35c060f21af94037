"""Lab hosts of another CPU architecture: Debian's arm64 under qemu-user, through binfmt_misc.

`Lab(arches={"node4": "arm64"})` boots node4 from an arm64 Debian root (lab/base.py: its own
cached base per release and architecture). Every binary in it, its systemd first, runs under
`qemu-aarch64` (Debian's qemu-user-static), which the kernel starts for each arm64 ELF through
the binfmt_misc entry `qemu-aarch64`. That entry needs the flags of NEEDED; ensure() registers
Debian's (/usr/lib/binfmt.d/qemu-aarch64.conf) with them.

Emulation is slow (a core runs arm64 code several times slower than its own) and incomplete:
systemd cannot set up a unit's credentials under qemu-user (lab/base.py, EMULATED_SETUP).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from meshdeploy.lab.errors import LabError, per_host

NATIVE = "amd64"  # the machine's own: the lab's hosts unless `arches` names another
# Debian's architecture name -> the kernel's (`uname -m`), for those a lab host can run.
ARCHES = {"amd64": "x86_64", "arm64": "aarch64"}
# An emulated host's first boot (ssh-keygen -A alone takes seconds under qemu) takes about
# 90 s here against 10 for a native one: the lab waits this much longer per such host.
BOOT_EXTRA = 180
# The flags a lab host needs of its qemu entry: F, the interpreter opened when it is registered
# (the host's root has no qemu), and C, a setuid binary's credentials for the process qemu runs
# it in (sudo, su, and systemd's setuid helpers would not be root without it: "sudo: effective
# uid is not 0"). Debian registers qemu-user-static's entries with POF; the lab registers them
# again with C added, for the whole machine, and leaves them so (docs/lab.md). With C, whoever
# runs a setuid arm64 binary gets qemu running as root, and qemu takes settings from its
# caller's environment (QEMU_LD_PREFIX and the like): so the folders above every arm64 root the
# lab keeps (its base, a host's overlay) are root's alone (confine()), and no other user of
# the machine can reach a setuid arm64 binary through them.
NEEDED = "CF"
BINFMT = Path("/proc/sys/fs/binfmt_misc")
BINFMT_CONF = Path("/usr/lib/binfmt.d")
HINT = "apt install qemu-user-static (Debian's arm64 emulation)"


def check_arch(arch: str) -> str:
    if arch not in ARCHES:
        raise LabError(f"unknown architecture {arch!r} for a lab host; one of "
                       + ", ".join(ARCHES))
    return arch


def resolve(chosen: dict[str, str] | None, host_names: list[str]) -> dict[str, str]:
    """The architecture of every host (NATIVE unless `chosen` names it), checked."""
    return per_host(chosen, host_names, "host architectures", check_arch, NATIVE)


def entry(arch: str, root: Path = BINFMT) -> Path:
    return root / f"qemu-{ARCHES[arch]}"


def flags(arch: str, root: Path = BINFMT) -> str | None:
    """The flags of `arch`'s qemu entry; None where there is none or it is disabled."""
    path = entry(arch, root)
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    if "enabled" not in lines:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("flags:")), "")


def ensure(arch: str, root: Path = BINFMT, conf: Path = BINFMT_CONF) -> None:
    """Make the kernel run `arch`'s binaries as a lab host needs (nothing to do for NATIVE):
    binfmt_misc mounted, Debian's qemu entry registered with the flags of NEEDED (module
    docstring), replacing one without them."""
    if arch == NATIVE:
        return
    if not (root / "register").exists():
        proc = subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(root)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise LabError(f"cannot mount binfmt_misc on {root}: {proc.stderr.strip()}",
                           hint="the kernel needs CONFIG_BINFMT_MISC for lab hosts of "
                                "another architecture")
    have = flags(arch, root)
    if have is not None and set(NEEDED) <= set(have):
        return
    line = conf / f"{entry(arch).name}.conf"
    if not line.exists():
        raise LabError(f"no qemu for {arch} lab hosts ({line} is missing)", hint=HINT)
    fields = line.read_text().strip().split(":")
    fields[-1] = "".join(sorted(set(fields[-1]) | set(NEEDED)))
    if entry(arch, root).exists():
        entry(arch, root).write_text("-1\n")  # its flags cannot be changed in place
    (root / "register").write_text(":".join(fields) + "\n")
    if not set(NEEDED) <= set(flags(arch, root) or ""):
        raise LabError(f"registering {line} with binfmt_misc (flags {fields[-1]}) did not take")


def confine(folder: Path, arch: str) -> None:
    """Make `folder`, above an arm64 root, root's alone (NEEDED says why); nothing for NATIVE."""
    if arch != NATIVE and folder.exists():
        folder.chmod(0o700)
