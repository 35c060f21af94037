"""Kinds of lab host: who logs in, on which port, and what runs that user's services.

- `root`: the user deploy with passwordless sudo, sshd on 22 (every host before kinds existed).
- `rootless-systemd`: the user md, no sudo; systemd --user runs for md from boot (lingering),
  and sshd's PAM session gives a non-interactive command its XDG_RUNTIME_DIR, so
  `systemctl --user` and `journalctl --user` work over `ssh host cmd`.
- `termux`: a phone under Termux, as far as a Debian host can imitate one: the user md, no sudo,
  a prefix and home of md's own under /data/data/com.termux/files, no systemd for md, runit's
  runsvdir running as md over $SVDIR (termux-services), sshd on 8022 only, and the session
  environment Termux gives (PREFIX, SVDIR, LOGDIR, TMPDIR, PATH).

Every host of a lab boots from the same base (base.recipe with user_services when any host is
not `root`); what makes a host its kind is written into its own overlay before its first boot,
by the kind's script below, run in a chroot of that root. In hosts of the md kinds the lab's key
logs in as md only; root takes the lab's admin key (Lab.admin_key), which the lab uses for its
readiness check and LabInfo.run(root=True), and which nothing the product is given holds.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

from meshdeploy.lab.errors import LabError, check_hosts

ROOT = "root"
ROOTLESS_SYSTEMD = "rootless-systemd"
TERMUX = "termux"

TERMUX_FILES = "/data/data/com.termux/files"
TERMUX_HOME = f"{TERMUX_FILES}/home"
TERMUX_PREFIX = f"{TERMUX_FILES}/usr"
# What Termux's shell has, and so what its sshd hands a session: the app sets PREFIX, HOME and
# TMPDIR and puts $PREFIX/bin first on PATH; termux-services' profile.d script adds SVDIR and
# LOGDIR. /usr/bin stays on PATH: the lab's tools (toolchain, runit) live there, not in $PREFIX.
TERMUX_ENV = (
    ("PREFIX", TERMUX_PREFIX),
    ("SVDIR", f"{TERMUX_PREFIX}/var/service"),
    ("LOGDIR", f"{TERMUX_PREFIX}/var/log"),
    ("TMPDIR", f"{TERMUX_PREFIX}/tmp"),
    ("PATH", f"{TERMUX_PREFIX}/bin:/usr/local/bin:/usr/bin:/bin"),
)

# Both md kinds: the host has no deploy (and so no sudoers entry) and a user md with no sudo and
# a locked password; root's password stays locked as debootstrap leaves it.
_NO_ROOT_USER = r"""
set -eu
if id deploy >/dev/null 2>&1; then
    userdel --remove deploy 2>/dev/null
fi
rm -f /etc/sudoers.d/deploy
"""

ROOTLESS_SYSTEMD_SCRIPT = _NO_ROOT_USER + r"""
id md >/dev/null 2>&1 || useradd --create-home --shell /bin/bash md
install -d -m 0700 -o md -g md /home/md/.ssh
# What `loginctl enable-linger md` leaves behind (loginctl needs a running logind): logind
# starts user@UID.service for every name in this directory when it starts, at boot.
install -d -m 0755 /var/lib/systemd/linger
: > /var/lib/systemd/linger/md
# A persistent journal: only there does journald keep a journal file per user that the user may
# read (journald.conf(5), SplitMode=uid: volatile storage keeps one file, readable by root and
# the systemd-journal group only), and `journalctl --user` reads that file. Debian's systemd
# makes the directory already (checked: without it md's units' lines are not readable to md);
# made here all the same, as this kind depends on it.
install -d -m 2755 -g systemd-journal /var/log/journal
"""

TERMUX_SCRIPT = _NO_ROOT_USER + r"""
# Inputs: PREFIX, SVDIR, LOGDIR, TERMUX_HOME, SESSION_ENV (sshd's SetEnv words).
# Android makes the app's files directory; /data and /data/data belong to the system.
install -d -m 0771 /data /data/data
id md >/dev/null 2>&1 || useradd --no-create-home --home-dir "$TERMUX_HOME" --shell /bin/bash md
install -d -m 0700 -o md -g md /data/data/com.termux
for dir in /data/data/com.termux/files "$TERMUX_HOME" "$TERMUX_HOME/.ssh" "$PREFIX" \
    "$PREFIX/bin" "$PREFIX/etc" "$PREFIX/lib" "$PREFIX/share" "$PREFIX/tmp" "$PREFIX/var" \
    "$SVDIR" "$LOGDIR" "$LOGDIR/sv" "$PREFIX/share/termux-services"; do
    install -d -m 0700 -o md -g md "$dir"
done
# termux-services' helpers: enable and disable a service by its `down` file, and the logger a
# service's log/run execs (svlogd into $LOGDIR/sv/NAME).
cat > "$PREFIX/bin/sv-enable" <<'EOF'
#!/bin/sh
[ $# -eq 1 ] || { echo "usage: sv-enable SERVICE" >&2; exit 1; }
rm -f "$SVDIR/$1/down"
exec sv up "$1"
EOF
cat > "$PREFIX/bin/sv-disable" <<'EOF'
#!/bin/sh
[ $# -eq 1 ] || { echo "usage: sv-disable SERVICE" >&2; exit 1; }
touch "$SVDIR/$1/down"
exec sv down "$1"
EOF
cat > "$PREFIX/share/termux-services/svlogger" <<'EOF'
#!/bin/sh
# A service's log/run: svlogd into $LOGDIR/sv/<the service's name>.
name=$(basename "$(dirname "$(pwd)")")
mkdir -p "$LOGDIR/sv/$name"
exec svlogd -tt "$LOGDIR/sv/$name"
EOF
chown md:md "$PREFIX/bin/sv-enable" "$PREFIX/bin/sv-disable" \
    "$PREFIX/share/termux-services/svlogger"
chmod 0700 "$PREFIX/bin/sv-enable" "$PREFIX/bin/sv-disable" \
    "$PREFIX/share/termux-services/svlogger"
# Termux's sshd runs as the app, so never on a port below 1024: 8022, and nothing on 22.
cat > /etc/ssh/sshd_config.d/termux.conf <<EOF
Port 8022
SetEnv $SESSION_ENV
EOF
# No systemd for md: Termux has none. No user manager (masked), and no logind session either
# (no pam_systemd), so a session has no XDG_RUNTIME_DIR, as in Termux.
ln -sf /dev/null /etc/systemd/system/user@.service
sed -i '/pam_systemd\.so/d' /etc/pam.d/common-session
# This unit stands in for the Termux app: termux-services' profile.d script starts runsvdir as
# the app's user when the app opens its first shell; here it starts at boot, as md, with the
# environment that shell has. Nothing else in this host runs as md on its own.
cat > /etc/systemd/system/termux-services.service <<EOF
[Unit]
Description=termux-services: runsvdir of md over $SVDIR (stands in for the Termux app)

[Service]
User=md
Group=md
WorkingDirectory=$TERMUX_HOME
Environment=HOME=$TERMUX_HOME $SESSION_ENV
ExecStart=/usr/bin/runsvdir -P $SVDIR
Restart=on-failure

[Install]
WantedBy=multi-user.target
EOF
ln -sf /etc/systemd/system/termux-services.service \
    /etc/systemd/system/multi-user.target.wants/termux-services.service
"""


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    user: str  # who the lab's key logs in as (ssh_config's User)
    port: int  # where the host's sshd listens
    script: str  # run as root in a chroot of the host's root before its first boot; "" = none
    env: tuple[tuple[str, str], ...] = ()  # the script's inputs

    @property
    def has_root(self) -> bool:
        return self.name == ROOT


KINDS = {
    k.name: k
    for k in (
        Kind(ROOT, "deploy", 22, ""),
        Kind(ROOTLESS_SYSTEMD, "md", 22, ROOTLESS_SYSTEMD_SCRIPT),
        Kind(TERMUX, "md", 8022, TERMUX_SCRIPT, (
            *((k, v) for k, v in TERMUX_ENV if k in ("PREFIX", "SVDIR", "LOGDIR")),
            ("TERMUX_HOME", TERMUX_HOME),
            ("SESSION_ENV", " ".join(f"{k}={v}" for k, v in TERMUX_ENV)),
        )),
    )
}


def parse(values: list[str], flag: str = "--kind", example: str = TERMUX) -> dict[str, str]:
    """`--kind HOST=KIND` values (or another `flag`'s HOST=VALUE) as a dict; a repeated host or
    a malformed value is an error (the values are checked by resolve, base.resolve_suites)."""
    chosen: dict[str, str] = {}
    what = flag.removeprefix("--").upper()
    for value in values:
        host, sep, kind = value.partition("=")
        if not sep or not host or not kind:
            raise LabError(f"{flag} {value!r}: write HOST={what}, e.g. {flag} node2={example}")
        if host in chosen:
            raise LabError(f"{flag} names {host} twice ({chosen[host]}, {kind})")
        chosen[host] = kind
    return chosen


def resolve(chosen: dict[str, str] | None, host_names: list[str],
            toolchain: bool) -> dict[str, str]:
    """The kind of every host (ROOT unless `chosen` names it), checked: known kinds and hosts
    only, and kinds other than ROOT only on the toolchain base (their packages join it)."""
    chosen = dict(chosen or {})
    check_hosts(chosen, host_names, "host kinds")
    for host, kind in sorted(chosen.items()):
        if kind not in KINDS:
            raise LabError(f"{host}: unknown host kind {kind!r}; kinds: {', '.join(KINDS)}")
    rootless = sorted(h for h, k in chosen.items() if k != ROOT)
    if rootless and not toolchain:
        raise LabError(f"host kinds other than {ROOT} ({', '.join(rootless)}) run on the "
                       "toolchain base: add toolchain=True (--toolchain)")
    return {h: chosen.get(h, ROOT) for h in host_names}


def user_services(kinds: dict[str, str]) -> bool:
    """Whether the lab boots from the base with USER_SERVICES (any host not ROOT)."""
    return any(k != ROOT for k in kinds.values())


def apply(root: Path, kind: str) -> None:
    """Make the host whose root is mounted at `root` one of kind `kind` (before it boots)."""
    spec = KINDS[kind]
    if not spec.script:
        return
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C", **dict(spec.env)}
    proc = subprocess.run(["chroot", str(root), "/bin/sh", "-c", spec.script], env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
        raise LabError(f"making {root.parent.name} a {kind} host failed (exit "
                       f"{proc.returncode}): {tail}")

