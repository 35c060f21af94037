"""Where a host's service definitions live and how they are (re)started, per service manager:
systemd and launchd on hosts with root, systemd --user and runit (termux-services) on rootless
hosts (config.model.Layout.manager, read from the host by core.account).

Every manager gives the same operations (services.operations and services.orchestrator use
nothing else): `name` and `path` of a unit, `write` of its definition, `install` (start it anew
after a write), `restart`, `stop`, `remove`, `journal` (its last lines on stderr when it fails),
`reload` after removals and `label` for the plan's diff.
"""

from __future__ import annotations

from pathlib import Path

from meshdeploy.config.model import RUNIT, SYSTEMD_USER
from meshdeploy.core import shell
from meshdeploy.core.units import comment_value, render, unit_name
from meshdeploy.roles.services import defaults as d

TEMPLATES = Path(__file__).with_name("templates")


class Systemd:
    """Where units live and how they are (re)started on systemd hosts."""

    systemctl: tuple[str, ...] = ("systemctl",)  # the manager install and restart talk to

    def name(self, unit: str) -> str:
        return unit_name(unit, "service name")

    def path(self, unit: str) -> str:
        return f"{d.services_unit_dir}/{unit}.service"

    def label(self, unit: str) -> str:
        return f"{unit}.service"

    def write(self, unit: str, content: str) -> list[str]:
        return [shell.write_file(self.path(unit), content)]

    def differs(self, have: dict, want: str, unit: str) -> bool:
        return have["content"] != want

    def install(self, unit: str) -> str:
        """After an existing unit's file was rewritten: systemd reloads, then enabled and
        restarted. Always: NeedDaemonReload compares times, and a host whose clock went back
        (no RTC, before NTP) would write an older time than the copy systemd holds."""
        ctl = self.systemctl
        return shell.command(*ctl, "daemon-reload", shell.AND, *ctl, "enable", "--no-reload",
                             "--quiet", unit, shell.AND, *ctl, "restart", unit)

    def start_new(self, unit: str) -> str:
        """After a new unit's file was written: the same as restart (a unit systemd never loaded,
        or knows as not found, is read from its file when restarted)."""
        return self.restart(unit)

    def restart(self, unit: str) -> str:
        """Enabled and restarted, systemd reloading its configuration only when it holds an older
        copy of this unit than its file (NeedDaemonReload). A reload reruns every generator and
        rereads every unit file, and `systemctl enable` does one unless --no-reload: 60 of them
        in a 30-host apply."""
        return reload_if_stale(self.systemctl, unit)

    def stop(self, unit: str) -> str:
        """Stopped if it runs; nothing when it does not exist yet."""
        return shell.command("systemctl", "stop", unit, shell.QUIET, shell.THEN, "true")

    def remove(self, unit: str) -> str:
        return shell.command("systemctl", "disable", "--now", unit, shell.QUIET,
                             shell.THEN, "rm", "-f", self.path(unit))

    def reload(self) -> list[str]:
        """After units were removed."""
        return ["systemctl daemon-reload"]

    def forget(self, unit: str) -> list[str]:
        """After `remove` on destroy: a llama-server whose workers stopped first ends
        "failed"; reset, so systemd forgets it."""
        return [shell.command("systemctl", "daemon-reload", shell.AND, "systemctl",
                              "reset-failed", unit, shell.QUIET, shell.OR, "true")]

    def journal(self, unit: str) -> str:
        return shell.command("journalctl", "-u", unit, "-n", d.services_journal_lines,
                             "--no-pager", "-o", "cat", shell.TO_STDERR, shell.QUIET,
                             shell.OR, "true")


class Launchd(Systemd):
    """The same on macOS: LaunchDaemon plists, launchctl bootstrap/kickstart."""

    def name(self, unit: str) -> str:
        return unit_name(d.services_launchd_prefix + unit.removeprefix(d.services_unit_prefix),
                         "service name")

    def path(self, unit: str) -> str:
        return f"{d.services_launchd_dir}/{unit}.plist"

    def start_new(self, unit: str) -> str:
        return self.install(unit)

    def install(self, unit: str) -> str:
        return (shell.command("mkdir", "-p", d.services_launchd_log_dir) + " && ("
                + shell.command("launchctl", "bootout", f"system/{unit}", shell.QUIET,
                                shell.THEN, "true")
                + ") && " + shell.command("launchctl", "bootstrap", "system", self.path(unit)))

    def restart(self, unit: str) -> str:
        return shell.command("launchctl", "kickstart", "-k", f"system/{unit}", shell.QUIET,
                             shell.OR, "launchctl", "bootstrap", "system", self.path(unit))

    def stop(self, unit: str) -> str:
        """Unloaded if loaded (restart bootstraps it again)."""
        return shell.command("launchctl", "bootout", f"system/{unit}", shell.QUIET,
                             shell.THEN, "true")

    def remove(self, unit: str) -> str:
        return shell.command("launchctl", "bootout", f"system/{unit}", shell.QUIET, shell.THEN,
                             "rm", "-f", self.path(unit))

    def reload(self) -> list[str]:
        return []

    def forget(self, unit: str) -> list[str]:
        return []

    def journal(self, unit: str) -> str:
        return _tail(f"{d.services_launchd_log_dir}/{unit}.log")


class SystemdUser(Systemd):
    """systemd --user on a rootless Linux host: unit files in the user's unit folder
    (Layout.services), `systemctl --user`, `journalctl --user`. Lingering (checked by
    core.account) keeps the manager, and the services, up without a login."""

    systemctl = ("systemctl", "--user")  # install and restart as Systemd's

    def __init__(self, layout):
        self.layout = layout

    def path(self, unit: str) -> str:
        return f"{self.layout.services}/{unit}.service"

    def stop(self, unit: str) -> str:
        return shell.command("systemctl", "--user", "stop", unit, shell.QUIET, shell.THEN,
                             "true")

    def remove(self, unit: str) -> str:
        return shell.command("systemctl", "--user", "disable", "--now", unit, shell.QUIET,
                             shell.THEN, "rm", "-f", self.path(unit))

    def reload(self) -> list[str]:
        return [shell.command("systemctl", "--user", "daemon-reload")]

    def forget(self, unit: str) -> list[str]:
        return [shell.command("systemctl", "--user", "daemon-reload", shell.AND, "systemctl",
                              "--user", "reset-failed", unit, shell.QUIET, shell.OR, "true")]

    def journal(self, unit: str) -> str:
        return shell.command("journalctl", "--user", "-u", unit, "-n",
                             d.services_journal_lines, "--no-pager", "-o", "cat",
                             shell.TO_STDERR, shell.QUIET, shell.OR, "true")


class Runit(Systemd):
    """runit as the login user (termux-services): a service folder per unit under $SVDIR
    (Layout.services) with `run` (the service) and `log/run` (svlogd -tt into
    runit_log_dir), supervised by the user's runsvdir, controlled with `sv` on the folder's
    path. Enabled means the folder has no `down` file.

    + tools: the RunitTools fact ({"sh", "svlogd"}): the paths the scripts' first lines name
    + cluster: the cluster's name, for the files' first comment
    """

    def __init__(self, layout, tools: dict | None = None, cluster: str = ""):
        self.layout = layout
        self.tools = tools or {}
        self.cluster = cluster

    def path(self, unit: str) -> str:
        """The service folder (its `run` is the unit's content)."""
        return f"{self.layout.services}/{unit}"

    def label(self, unit: str) -> str:
        return f"{unit}/run"

    def log_dir(self, unit: str) -> str:
        return log_dir(self.layout, unit)

    def _beside(self, unit: str, suffix: str) -> str:
        """A dot-name beside the folder: runsvdir never starts a service from it."""
        return f"{self.layout.services}/.{unit}.{suffix}"

    def log_run(self, unit: str) -> str:
        # Without the RunitTools fact (see rootless.want): the POSIX names.
        return render(TEMPLATES / "runit.log-run", sh=self.tools.get("sh") or "/bin/sh",
                      cluster=comment_value(self.cluster, "cluster"), unit=unit,
                      svlogd=shell.quote(self.tools.get("svlogd") or "svlogd"),
                      folder=shell.quote(self.log_dir(unit)))

    def differs(self, have: dict, want: str, unit: str) -> bool:
        return have["content"] != want or have.get("log") != self.log_run(unit)

    def write(self, unit: str, content: str) -> list[str]:
        """svlogd's folder (0700), then run and log/run written under a dot-name beside the
        service folder and moved in (runit-move.sh)."""
        new, logs = self._beside(unit, "meshdeploy-new"), self.log_dir(unit)
        return [shell.command("mkdir", "-p", logs, shell.AND, "chmod", "700", logs, shell.AND,
                              "rm", "-rf", new),
                shell.write_file(f"{new}/run", content, "0700"),
                shell.write_file(f"{new}/log/run", self.log_run(unit), "0700"),
                shell.template(TEMPLATES / "runit-move.sh", DIR=self.path(unit), NEW=new)]

    def start_new(self, unit: str) -> str:
        return self.install(unit)

    def install(self, unit: str) -> str:
        return shell.template(TEMPLATES / "runit-up.sh", DIR=self.path(unit),
                              WAIT=d.services_runit_wait_seconds, WHO=unit)

    def restart(self, unit: str) -> str:
        return self.install(unit)

    def stop(self, unit: str) -> str:
        """Down, and waited for (as systemctl stop waits): at most services_runit_wait_seconds."""
        return shell.command("sv", "-w", d.services_runit_wait_seconds, "down", self.path(unit),
                             shell.QUIET, shell.THEN, "true")

    def remove(self, unit: str) -> str:
        return shell.template(TEMPLATES / "runit-remove.sh", DIR=self.path(unit),
                              GONE=self._beside(unit, "meshdeploy-gone"),
                              LOGS=self.log_dir(unit))

    def reload(self) -> list[str]:
        return []

    def forget(self, unit: str) -> list[str]:
        return []

    def journal(self, unit: str) -> str:
        return _tail(f"{self.log_dir(unit)}/current")


def reload_if_stale(systemctl: tuple[str, ...], unit: str) -> str:
    """`systemctl [--user] enable --no-reload U`, `daemon-reload` only when systemd's copy of U
    is older than its file, then `restart U`."""
    stale = shell.command(*systemctl, "show", "-p", "NeedDaemonReload", "--value", unit)
    return (shell.command(*systemctl, "enable", "--no-reload", "--quiet", unit, shell.AND)
            + f' {{ [ "$({stale})" != yes ] || '
            + shell.command(*systemctl, "daemon-reload") + "; } && "
            + shell.command(*systemctl, "restart", unit))


def _tail(path: str) -> str:
    """The last lines of a service's log file on stderr (nothing when it has none)."""
    return shell.command("tail", "-n", d.services_journal_lines, path, shell.TO_STDERR,
                         shell.QUIET, shell.OR, "true")


def log_dir(layout, unit: str) -> str:
    """svlogd's folder of a runit service: under the user's cache, never the service folder
    (Termux's $PREFIX/var/service is for definitions)."""
    return f"{layout.cache}/{d.services_runit_log_dir}/{unit}"


def for_layout(layout, tools: dict | None = None, cluster: str = ""):
    """The rootless manager of `layout`, or None on a host with root."""
    if layout is not None and layout.manager == SYSTEMD_USER:
        return SystemdUser(layout)
    if layout is not None and layout.manager == RUNIT:
        return Runit(layout, tools, cluster)
    return None
