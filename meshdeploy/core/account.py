"""A rootless host's account: who the login user is, its folders and its service manager, read
from the host before the probe (the probe's own commands name those folders).

A host with root has a fixed layout (config.model.system_layout). A rootless host keeps
everything in folders its login user owns, by the XDG rules (`$XDG_DATA_HOME` or
~/.local/share for builds and models, `$XDG_CACHE_HOME` or ~/.cache for the rpc-servers' caches,
`$XDG_RUNTIME_DIR` for locks and markers), and its services run under the first of:

- systemd --user, when the user's manager answers and lingering is on (without lingering it
  stops with the user's last session, and with it every service);
- runit as the user (termux-services: `runsvdir` over `$SVDIR`, Termux's `$PREFIX/var/service`
  when SVDIR is unset), when `sv` is on PATH and a runsvdir of this user runs.

What is read is data: every value is checked here (absolute, no control characters) before a
path is made from it, and paths reach shells and unit files quoted like any other value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from meshdeploy.config.model import RUNIT, SYSTEMD_USER, Cluster, Host, Layout
from meshdeploy.errors import PlanError

# One `key=value` line each; values are read as the login user sees them (no sudo).
SCRIPT = r"""
printf 'home=%s\n' "$HOME"
printf 'user=%s\n' "$(id -un)"
printf 'uid=%s\n' "$(id -u)"
printf 'termux_prefix=%s\n' "${PREFIX-}"
printf 'svdir=%s\n' "${SVDIR-}"
printf 'xdg_data=%s\n' "${XDG_DATA_HOME-}"
printf 'xdg_cache=%s\n' "${XDG_CACHE_HOME-}"
printf 'xdg_config=%s\n' "${XDG_CONFIG_HOME-}"
printf 'runtime=%s\n' "${XDG_RUNTIME_DIR-}"
if command -v systemctl >/dev/null 2>&1; then
  printf 'systemd_user=%s\n' "$(systemctl --user is-system-running 2>/dev/null | head -n 1)"
  printf 'linger=%s\n' "$(loginctl show-user "$(id -un)" -p Linger --value 2>/dev/null)"
fi
command -v sv >/dev/null 2>&1 && printf 'sv=yes\n'
ps -ww -o args= -u "$(id -u)" 2>/dev/null | grep -E '^([^ ]*/)?runsvdir( |$)' | sed 's/^/runsvdir=/'
true
""".lstrip()

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")  # C0, DEL and C1 (a terminal reads CSI)
# What a login name may be: POSIX's portable user names (it is printed in plans).
_USER = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]{0,63}")
# What `systemctl --user is-system-running` prints when a user manager answers.
_ANSWERING = {"running", "degraded", "starting", "initializing", "maintenance"}


@dataclass(frozen=True)
class Account:
    """What SCRIPT read on one host."""

    host: str
    values: dict

    def get(self, key: str) -> str:
        value = self.values.get(key, "")
        return value if isinstance(value, str) else ""

    @property
    def user(self) -> str:
        """The login name, when it is a portable user name (it reaches plans and hints)."""
        name = self.get("user")
        return name if _USER.fullmatch(name) else "the login user"


def parse(host: str, lines: list[str]) -> Account:
    values: dict = {}
    for line in lines:
        key, sep, value = line.partition("=")
        if not (sep and key):
            continue
        if key == "runsvdir":  # one line per runsvdir of the user: its command line
            values.setdefault(key, []).append(value)
        elif key not in values:
            values[key] = value
    return Account(host, values)


def manager(account: Account) -> str:
    """SYSTEMD_USER or RUNIT; PlanError naming the one command that fixes a host that has
    neither (nothing is installed on it first)."""
    user = account.user
    if account.get("systemd_user") in _ANSWERING:
        if account.get("linger") != "yes":
            raise PlanError(
                f"host {account.host}: systemd --user answers for {user}, but lingering is off: "
                "its services would stop when the last login of the user ends",
                hint=f"an administrator of the host runs, once: loginctl enable-linger {user}")
        return SYSTEMD_USER
    svdir = _svdir(account).rstrip("/")
    if account.get("sv") == "yes" and svdir and any(
            f" {svdir} " in f" {args} " or f" {svdir}/ " in f" {args} "
            for args in account.values.get("runsvdir", [])):
        return RUNIT
    raise PlanError(
        f"host {account.host}: no service manager for {user}: systemd --user does not answer "
        f"and no runsvdir of the user runs over {svdir or 'SVDIR (unset)'}",
        hint=f"on Linux, an administrator runs: loginctl enable-linger {user}; under Termux: "
             "pkg install termux-services, then restart Termux (it starts runsvdir)")


def _svdir(account: Account) -> str:
    if account.get("svdir"):
        return account.get("svdir")
    if account.get("termux_prefix"):
        return account.get("termux_prefix") + "/var/service"
    return ""


def _absolute(account: Account, key: str, value: str) -> str:
    if not value.startswith("/") or _CONTROL.search(value) or "/../" in value + "/":
        raise PlanError(f"host {account.host}: {key} is {value!r}, not an absolute path "
                        "meshdeploy can use",
                        hint="check the login user's environment on the host (HOME, "
                             "XDG_*_HOME, SVDIR)")
    return value.rstrip("/") or "/"


def layout(account: Account) -> Layout:
    """The rootless host's folders and service manager."""
    mgr = manager(account)
    home = _absolute(account, "HOME", account.get("home"))

    def xdg(key: str, default: str) -> str:
        value = account.get(key)
        return _absolute(account, key, value) if value else f"{home}/{default}"

    cache = f"{xdg('xdg_cache', '.cache')}/meshdeploy"
    runtime = account.get("runtime")
    run = f"{_absolute(account, 'XDG_RUNTIME_DIR', runtime)}/meshdeploy" if runtime \
        else f"{cache}/run"
    config = xdg("xdg_config", ".config")
    if mgr == SYSTEMD_USER:
        services = f"{config}/systemd/user"
    else:
        services = _absolute(account, "SVDIR", _svdir(account))
    return Layout(prefix=f"{xdg('xdg_data', '.local/share')}/meshdeploy", cache=cache, run=run,
                  services=services, manager=mgr, home=home, config=f"{config}/meshdeploy",
                  user=account.user if _USER.fullmatch(account.get("user")) else "")


def resolved(cluster: Cluster, layouts: dict[str, Layout]) -> Cluster:
    """`cluster` with each rootless host's layout filled in from `layouts` (host name ->)."""
    hosts = tuple(replace(h, layout=layouts[h.name]) if h.rootless and h.name in layouts else h
                  for h in cluster.hosts)
    return replace(cluster, hosts=hosts)


def resolved_host(host: Host, found: Layout) -> Host:
    return replace(host, layout=found)
