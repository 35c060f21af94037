"""network: the allow-list of each host's meshdeploy ports, kept in the `inet meshdeploy` table."""

from __future__ import annotations

from meshdeploy.deploy import shell
from meshdeploy.deploy.context import HostContext, Step
from meshdeploy.deploy.errors import PlanError
from meshdeploy.deploy.probe import Section
from meshdeploy.roles.network import rules
from meshdeploy.roles.network.facts import Allowlist, Tools

ROLE = "network"
OPT_OUT = "network.firewall: false"


def sections(cluster, host) -> list[Section]:
    """The filters the host has, and the live table (nft needs root to list it). The table is
    read even with the firewall off, so turning it off removes what an earlier apply loaded."""
    return [Section("network.Tools", Tools),
            Section("network.Allowlist", Allowlist, privileged=True)]


def _darwin(ctx) -> bool:
    return (ctx.fact("toolchain.Platform") or {}).get("kernel") == "Darwin"


# How a Linux host without nft gets it: the package manager the toolchain's Platform fact saw.
_INSTALL = {"apt-get": ("export DEBIAN_FRONTEND=noninteractive; ",
                        ["apt-get", "update", "-qq", shell.AND,
                         "apt-get", "install", "-y", "-qq", "nftables"]),
            "dnf": ("", ["dnf", "install", "-y", "nftables"])}


def _installer(ctx) -> str | None:
    tools = (ctx.fact("toolchain.Platform") or {}).get("tools") or []
    for tool, (prefix, argv) in _INSTALL.items():
        if tool in tools:
            return prefix + shell.command(*argv)
    return None


def preflight(ctx: HostContext) -> None:
    """A host that must be firewalled, has no nft (nor pfctl on macOS) and cannot install
    nftables with apt or dnf is refused."""
    if not ctx.cluster.network.firewall:
        return None
    tools = ctx.fact("network.Tools") or []
    if not tools and (_darwin(ctx) or _installer(ctx) is None):
        raise PlanError(f"{ctx.host.name}: no packet filter to keep the RPC port private "
                        "(nft on Linux, pfctl on macOS)",
                        hint=f"install nftables on the host, or set {OPT_OUT} "
                             "(every plan then warns that rpc-server is open to its network)")
    return None


def warnings(cluster, facts: dict) -> list[str]:
    """What the plan says every time about hosts that are not firewalled."""
    if not cluster.network.firewall:
        return [f"{OPT_OUT}: no host filters its meshdeploy ports; any machine that reaches a "
                "worker's rpc-server port can read and write its memory"]
    macs = sorted(name for name, f in facts.items()
                  if (f.get("toolchain.Platform") or {}).get("kernel") == "Darwin")
    if macs:
        return [f"{', '.join(macs)}: macOS hosts are not firewalled by meshdeploy yet (the pf "
                "anchor is rendered, not loaded); their rpc-server ports are open to their "
                "network"]
    return []


def allowlist(ctx: HostContext) -> Step:
    """network.allowlist: rpc-server ports open only to their orchestrators, llama-server ports
    to loopback and what the file allows; the whole table replaced atomically (nft -f)."""
    live = ctx.fact("network.Allowlist")
    if not ctx.cluster.network.firewall or _darwin(ctx):
        if live is None:
            return Step(ctx.change(ROLE, "allowlist", "no-op",
                                   "firewall off" if not ctx.cluster.network.firewall
                                   else "macOS: not managed yet"))
        return Step(ctx.change(ROLE, "allowlist", "delete", f"{OPT_OUT}: remove the table",
                               rules.diffs({}, live)), rules.remove_commands())
    wanted = rules.allowlist(ctx.cluster, ctx.host)
    if not wanted:
        if live is None:
            return Step(ctx.change(ROLE, "allowlist", "no-op", "no meshdeploy port on this host"))
        return Step(ctx.change(ROLE, "allowlist", "delete", "no meshdeploy port on this host",
                               rules.diffs({}, live)), rules.remove_commands())
    if live == wanted:
        ports = ", ".join(sorted(wanted, key=int))
        return Step(ctx.change(ROLE, "allowlist", "no-op", f"ports {ports} filtered as wanted"))
    install = [] if "nft" in (ctx.fact("network.Tools") or []) else [_installer(ctx)]
    return Step(ctx.change(ROLE, "allowlist", "create" if live is None else "update",
                           "not loaded" if live is None else "rules differ (drift or a new peer)",
                           rules.diffs(wanted, live)),
                [c for c in install if c] + rules.apply_commands(rules.nft_file(ctx.cluster,
                                                                                ctx.host)))
