"""network on macOS: the same allow-list as a pf anchor (rules.ports() is the one source).

Only `block` rules: in pf the last matching rule wins unless one is `quick`, so a `pass quick`
here would override the user's own blocks; a `block drop quick` for the sources not allowed
changes nothing else. Each port's sources sit in an anchor-local table, because pf expands
`from ! { a, b }` into rules that together match everything (pf.conf(5)).

The anchor is evaluated only where the main ruleset names it (`anchor "meshdeploy"` in
/etc/pf.conf, see pf_conf_lines()) and pf is enabled: the operation's preflight checks both.
Golden-tested only: no macOS host runs it here.
"""

from __future__ import annotations

from meshdeploy.deploy import shell
from meshdeploy.roles.network import defaults as d
from meshdeploy.roles.network.rules import LOOPBACK, Port, comment_text, ports


def anchor(port_list: list[Port], host_name: str) -> str:
    """The anchor's tables, then its rules (pf's own order), for `pfctl -a meshdeploy -f`."""
    lo = d.network_loopback_ifaces["pf"]
    tables, blocks = [], []
    for p in port_list:
        sources = [s for s in p.sources if s != LOOPBACK]
        # Without "lo" in the list nothing is exempt, loopback included.
        on = f" on ! {lo}" if LOOPBACK in p.sources else ""
        blocks.append(f"# {comment_text(p.what)}")
        if sources:
            table = f"meshdeploy_{p.port}"
            tables.append(f"table <{table}> const {{ {', '.join(sources)} }}")
            blocks.append(f"block drop in quick{on} proto tcp from ! <{table}> "
                          f"to any port {p.port}")
        else:
            blocks.append(f"block drop in quick{on} proto tcp to any port {p.port}")
    head = (f"# meshdeploy: allow-list of {comment_text(host_name)}'s meshdeploy ports "
            f'(anchor "{d.network_pf_anchor}"). Generated; the next apply replaces it.')
    return "\n".join([head, *tables, *blocks]) + "\n"


def anchor_file(cluster, host) -> str:
    return anchor(ports(cluster, host), host.name)


def pf_conf_lines() -> list[str]:
    """What /etc/pf.conf must hold for the anchor to count, and to come back at boot."""
    return [f'anchor "{d.network_pf_anchor}"',
            f'load anchor "{d.network_pf_anchor}" from "{d.network_pf_file}"']


def apply_commands(text: str) -> list[str]:
    """Check the anchor, then replace its rules and tables as one load (`pfctl -f` is atomic
    per anchor); the user's main ruleset is left as it is."""
    staged = f"{d.network_pf_file}.new"
    return [
        shell.write_file(staged, text, "0644"),
        shell.command("pfctl", "-n", "-a", d.network_pf_anchor, "-f", staged, shell.AND,
                      "pfctl", "-q", "-a", d.network_pf_anchor, "-f", staged, shell.AND,
                      "mv", "-f", staged, d.network_pf_file),
    ]


def remove_commands() -> list[str]:
    return [shell.command("pfctl", "-q", "-a", d.network_pf_anchor, "-F", "all", shell.QUIET,
                          shell.THEN, "rm", "-f", d.network_pf_file)]
