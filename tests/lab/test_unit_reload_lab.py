"""How services (re)start a unit on a real systemd host (the lab's rogue node4, in no cluster
file): systemd reloads its configuration only when its copy of the unit is older than the file
(managers.reload_if_stale). A reload reruns every generator and rereads every unit file, and a
plain `systemctl enable` does one each time: the counter below sees it do so, then sees none
for a new unit or an unchanged one, and one for a changed one, whose new content then runs. A
rewritten unit (Systemd.install) reloads whatever the file's time says."""

from __future__ import annotations

import pytest

from meshdeploy.core import shell
from meshdeploy.roles.services.managers import Systemd, reload_if_stale

pytestmark = pytest.mark.lab

HOST, UNIT = "node4", "md-reload-test"
PATH = f"/etc/systemd/system/{UNIT}.service"


def write(lab, description: str) -> None:
    unit = (f"[Unit]\nDescription={description}\n[Service]\nExecStart=/bin/sleep 1000\n"
            "[Install]\nWantedBy=multi-user.target\n")
    lab.run(HOST, shell.write_file(PATH, unit), root=True, check=True)


def reloads(lab) -> int:
    """How many times systemd has reloaded its configuration since boot (its journal says
    "Reloading" each time)."""
    out = lab.run(HOST, "journalctl -b _PID=1 -o cat --no-pager | grep -c '^Reloading' || true",
                  root=True, check=True).stdout
    return int(out.split()[-1])


def run(lab, command: str) -> int:
    """`command` on the host; the reloads it caused."""
    before = reloads(lab)
    lab.run(HOST, command, root=True, check=True)
    return reloads(lab) - before


def shown(lab) -> dict:
    out = lab.run(HOST, shell.command("systemctl", "show", "-p", "Description", "-p",
                                      "ActiveState", "-p", "UnitFileState", UNIT),
                  root=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.fixture
def clean(lab):
    yield
    lab.run(HOST, f"systemctl disable --now --quiet {UNIT}; rm -f {PATH}; "
                  "systemctl daemon-reload", root=True)


def test_systemd_reloads_only_for_a_unit_it_holds_an_older_copy_of(lab, clean):
    restart = reload_if_stale(("systemctl",), UNIT)
    # The probe asks for units that do not exist yet: systemd knows this one as not-found.
    lab.run(HOST, f"systemctl show -p LoadState {UNIT}", root=True, check=True)
    write(lab, "first")
    assert run(lab, restart) == 0
    assert shown(lab) == {"Description": "first", "ActiveState": "active",
                          "UnitFileState": "enabled"}
    # The counter sees a reload: the plain enable of an enabled, unchanged unit does one.
    assert run(lab, shell.command("systemctl", "enable", "--quiet", UNIT)) == 1
    assert run(lab, restart) == 0  # unchanged: restarted, no reload
    write(lab, "second")
    assert run(lab, restart) == 1
    assert shown(lab)["Description"] == "second" and shown(lab)["ActiveState"] == "active"


def test_a_rewritten_unit_runs_its_new_content_whatever_its_time(lab, clean):
    """NeedDaemonReload compares times: a file written while the host's clock was behind (no
    RTC, before NTP) looks older than systemd's copy, and the restart alone runs the old
    content. What a rewrite gets (Systemd.install) reloads anyway."""
    restart = reload_if_stale(("systemctl",), UNIT)
    write(lab, "first")
    run(lab, restart)
    write(lab, "second")
    lab.run(HOST, f"touch -d '-1 hour' {PATH}", root=True, check=True)
    assert run(lab, restart) == 0
    assert shown(lab)["Description"] == "first"  # the old content still runs
    assert run(lab, Systemd().install(UNIT)) == 1
    assert shown(lab)["Description"] == "second" and shown(lab)["ActiveState"] == "active"
