"""Facts of the services role: meshdeploy's unit files and their state."""

from __future__ import annotations

from pyinfra.api import FactBase

from meshdeploy.roles.services import defaults as d


class Units(FactBase):
    """meshdeploy's systemd units on the host.

    ```python
    {"meshdeploy-rpc-50052": {"active": "active", "enabled": "enabled", "content": "..."}}
    ```
    """

    def command(self):
        # systemd hosts list unit files; macOS hosts list LaunchDaemon plists, whose running
        # state launchctl print reports.
        return (f"for f in {d.services_unit_dir}/{d.services_unit_prefix}*.service; do "
                "[ -f \"$f\" ] || continue; n=${f##*/}; n=${n%.service}; "
                "echo \"@@unit $n $(systemctl is-active $n 2>/dev/null) "
                "$(systemctl is-enabled $n 2>/dev/null)\"; cat \"$f\"; done; "
                f"for f in {d.services_launchd_dir}/{d.services_launchd_prefix}*.plist; do "
                "[ -f \"$f\" ] || continue; n=${f##*/}; n=${n%.plist}; "
                "st=$(launchctl print system/$n 2>/dev/null | awk '/^\\tstate = / {print $3; exit}'); "
                "[ \"$st\" = running ] && st=active; "
                "echo \"@@unit $n ${st:-inactive} enabled\"; cat \"$f\"; done")

    def process(self, output):
        units: dict[str, dict] = {}
        lines: list[str] = []
        for line in output:
            if line.startswith("@@unit "):
                parts = line.split()
                lines = []
                units[parts[1]] = {"active": parts[2] if len(parts) > 2 else "unknown",
                                   "enabled": parts[3] if len(parts) > 3 else "unknown",
                                   "lines": lines}
            elif units:
                lines.append(line)
        for unit in units.values():
            unit["content"] = "\n".join(unit.pop("lines")) + "\n"
        return units

    @staticmethod
    def default():
        return {}
