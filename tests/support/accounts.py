"""Rootless hosts' accounts as core.account reads them from a host when a run connects; tests
that plan or render a cluster file without hosts give its rootless hosts these."""

from __future__ import annotations

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import account

# A phone under Termux: termux-services' runit, the app's home and prefix.
TERMUX = ["home=/data/data/com.termux/files/home", "user=u0_a123", "uid=10123", "sv=yes",
          "runsvdir=runsvdir -P /data/data/com.termux/files/usr/var/service", "termux_prefix=/data/data/com.termux/files/usr"]
# A shared Linux machine: systemd --user with lingering.
SYSTEMD_USER = ["home=/home/md", "user=md", "uid=1000", "systemd_user=running", "linger=yes",
                "runtime=/run/user/1000"]


def with_layouts(cluster, lines: list[str] = TERMUX):
    """`cluster` with every rootless host's layout read from `lines`."""
    return account.resolved(cluster, {h.name: account.layout(account.parse(h.name, lines))
                                      for h in cluster.hosts if h.rootless})


def load_inventory(path, lines: list[str] = TERMUX):
    """The cluster file at `path`, its rootless hosts given the account `lines`."""
    return with_layouts(load_cluster(path), lines)
