"""network on macOS: the same allow-list as a pf anchor (rules.ports() is the one source).

Only `block` rules: in pf the last matching rule wins unless one is `quick`, so a `pass quick`
here would override the user's own blocks; a `block drop quick` for the sources not allowed
changes nothing else. Each port's sources sit in an anchor-local table, because pf expands
`from ! { a, b }` into rules that together match everything (pf.conf(5)). Each rule matches
the port's own protocol (the WireGuard listen port is UDP).

Under WireGuard a tunnel-only source ("10.99.1.2 via mdwg0" in rules.ports()) is in the port's
table and in a second one whose addresses are refused `on !` the tunnel's interface; a source
that is this host's own tunnel address reaches it over loopback only. pf on macOS matches an
interface by its exact name (no interface groups, and `urpf-failed` never matches there), and
the tunnel's is a utun device known only once it is up: a macro names it (see _macro_lines).

The anchor is evaluated only where the main ruleset names it (`anchor "meshdeploy"` in
/etc/pf.conf, see pf_conf_lines()) and pf is enabled: the operation's preflight checks both.
Golden-tested only: no macOS host runs it here.
"""

from __future__ import annotations

import re

from meshdeploy.core import shell
from meshdeploy.roles.network import defaults as d
from meshdeploy.roles.network.rules import LOOPBACK, Port, comment_text, ports, split_source

_MACRO_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


def anchor(port_list: list[Port], host_name: str, local: tuple[str, ...] = ()) -> str:
    """The anchor's macros and tables, then its rules (pf's own order), for `pfctl -a
    meshdeploy -f`. `local`: this host's own addresses, which reach it over loopback only."""
    lo = d.network_loopback_ifaces["pf"]
    macros: dict[str, str] = {}
    tables, blocks = [], []
    for p in port_list:
        name = f"meshdeploy_{p.port}" if p.proto == "tcp" else f"meshdeploy_{p.proto}_{p.port}"
        # Without "lo" in the list nothing is exempt, loopback included.
        on = f" on ! {lo}" if LOOPBACK in p.sources else ""
        sources = [split_source(s) for s in p.sources if s != LOOPBACK]
        if on:
            sources = [(a, i) for a, i in sources if not (i and a in local)]
        match = f"proto {p.proto}"
        blocks.append(f"# {comment_text(p.what)}")
        everyone = list(dict.fromkeys(a for a, _ in sources))
        if everyone:
            tables.append(_table(name, everyone))
            blocks.append(f"block drop in quick{on} {match} from ! <{name}> to any port {p.port}")
        else:
            blocks.append(f"block drop in quick{on} {match} to any port {p.port}")
        # An address allowed only through an interface (a WireGuard peer's tunnel address) is
        # refused on every other one: from the LAN it would be a spoofed source.
        anywhere = {a for a, i in sources if not i}
        for n, iface in enumerate(sorted({i for _, i in sources if i}), 1):
            only = [a for a, i in sources if i == iface and a not in anywhere]
            if not only:
                continue
            macro = macros.setdefault(iface, f"meshdeploy_{_MACRO_UNSAFE.sub('_', iface)}")
            tables.append(_table(f"{name}_via{n}", only))
            blocks.append(f"block drop in quick on ! ${macro} {match} from <{name}_via{n}> "
                          f"to any port {p.port}")
    head = (f"# meshdeploy: allow-list of {comment_text(host_name)}'s meshdeploy ports "
            f'(anchor "{d.network_pf_anchor}"). Generated; the next apply replaces it.')
    return "\n".join([head, *_macro_lines(macros), *tables, *blocks]) + "\n"


def _table(name: str, addresses: list[str]) -> str:
    return f"table <{name}> const {{ {', '.join(addresses)} }}"


def _macro_lines(macros: dict[str, str]) -> list[str]:
    """One macro per tunnel interface. macOS has no interface by the configured name: wg-quick
    runs the tunnel on a utun device it names in /var/run/wireguard/<interface>.name, and pf
    matches interface names exactly. The default (the configured name, made a pf word) matches
    no packet, so the tunnel's sources stay refused until the anchor is loaded with
    `pfctl -D <macro>=utunN` (-D overrides a macro the file defines)."""
    out = []
    for iface, macro in macros.items():
        out += [f"# {comment_text(iface)}: on macOS its utun device, from "
                f"/var/run/wireguard/{comment_text(iface)}.name (pfctl -D {macro}=utunN)",
                f'{macro} = "{_MACRO_UNSAFE.sub("_", iface)}"']
    return out


def anchor_file(cluster, host) -> str:
    local = (cluster.source_address(host),) if cluster.network.tunnel else ()
    return anchor(ports(cluster, host), host.name, local)


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
