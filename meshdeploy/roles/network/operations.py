"""network: the allow-list of each host's meshdeploy ports, kept in the `inet meshdeploy` table."""

from __future__ import annotations

import hashlib
import posixpath

from meshdeploy.core import shell
from meshdeploy.core.context import HostContext, Step, Teardown
from meshdeploy.core.paths import model_share_port
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.probe import Section
from meshdeploy.errors import PlanError
from meshdeploy.roles.network import defaults as d
from meshdeploy.roles.network import rules, settings, ssh_ops
from meshdeploy.roles.network import tunnel as wgr
from meshdeploy.roles.network.facts import Allowlist, Tools, WireGuard

ROLE = "network"
# Whose run values say which hosts copy a build (Resolved.value: build_copiers).
LLAMA_CPP = "llama_cpp"
OPT_OUT = "network.firewall: false"


def sections(cluster, host, destroying: bool = False) -> list[Section]:
    """The filters the host has, and the live table (nft needs root to list it). The table is
    read even with the firewall off, so turning it off removes what an earlier apply loaded.
    A rootless host has neither (each needs root). network.transport: ssh's keys on both
    (ssh_ops.sections)."""
    keys = ssh_ops.sections(cluster, host, destroying)
    if host.rootless:
        return keys
    return [Section("network.Tools", Tools),
            Section("network.Allowlist", Allowlist, privileged=True),
            Section("network.WireGuard", WireGuard, privileged=True,
                    kwargs={"interface": settings.of(cluster).wireguard.interface,
                            "key": wgr.key_file(cluster), "conf": wgr.conf_path(cluster)}),
            *keys]


def _darwin(ctx) -> bool:
    return (ctx.fact("toolchain.Platform") or {}).get("kernel") == "Darwin"


# How a Linux host without a tool gets it: the package manager the toolchain's Platform fact saw.
_INSTALL = {"apt-get": ("export DEBIAN_FRONTEND=noninteractive; ",
                        ["apt-get", "update", "-qq", shell.AND,
                         "apt-get", "install", "-y", "-qq"]),
            "dnf": ("", ["dnf", "install", "-y"])}


def _installer(ctx, packages=("nftables",)) -> str | None:
    tools = (ctx.fact("toolchain.Platform") or {}).get("tools") or []
    for tool, (prefix, argv) in _INSTALL.items():
        if tool in tools:
            return prefix + shell.command(*argv, *packages)
    return None


def preflight(ctx: HostContext) -> None:
    """A host that must be firewalled, has no nft (nor pfctl on macOS) and cannot install
    nftables with apt or dnf is refused; so is an orchestrator of ssh forwards without ssh."""
    _wg_preflight(ctx)
    ssh_ops.preflight(ctx)
    if not ctx.cluster.network.firewall or ctx.host.rootless:
        return None
    tools = ctx.fact("network.Tools") or []
    if not tools and (_darwin(ctx) or _installer(ctx) is None):
        raise PlanError(f"{ctx.host.name}: no packet filter to keep the RPC port private "
                        "(nft on Linux, pfctl on macOS)",
                        hint=f"install nftables on the host, or set {OPT_OUT} "
                             "(every plan then warns that rpc-server is open to its network)")
    return None


def access(cluster, hosts, facts: dict) -> list[tuple[str, str, str]]:
    """What guards each host's meshdeploy ports, for the plan's Hosts table. Under
    network.transport: ssh a worker's rpc-servers listen on loopback only (the allow-list's
    input chain has no rule for them: rules.ports; on a root host its output chain keeps other
    local users out: rules.local_ports), and its other ports keep the allow-list where it has
    one."""
    out = []
    for h in hosts:
        darwin = (facts.get(h.name, {}).get("toolchain.Platform") or {}).get("kernel") == "Darwin"
        guard = ("nothing: network.firewall false" if not cluster.network.firewall else
                 "nothing: unprotected (no root for nftables)" if h.rootless else
                 "nothing: macOS pf anchor not loaded yet" if darwin else
                 "allow-list (nftables)")
        if cluster.network.forwarded and cluster.forwarded_to(h):
            forwarded = "loopback only; reached through ssh forwards"
            if rules.local_ports(cluster, h, None) and not guard.startswith("nothing"):
                forwarded = ("loopback only, for root and the login user (nftables); reached "
                             "through ssh forwards")
            guard = forwarded if guard.startswith("nothing") or not rules.ports(
                cluster, h) else f"{forwarded}; {guard}"
        if cluster.network.tunnel and cluster.tunnel_peers(h):
            guard += "; RPC through WireGuard"
        out.append((h.name, "protection", guard))
    return out


def warnings(cluster, facts: dict) -> list[str]:
    """What the plan says every time about hosts that are not firewalled."""
    sshd = ssh_ops.sshd_warnings(cluster, facts)
    if not cluster.network.firewall:  # the opt-out itself: cluster_file.warnings
        return sshd
    macs = sorted(name for name, f in facts.items()
                  if (f.get("toolchain.Platform") or {}).get("kernel") == "Darwin")
    out = sshd
    tunneled = [m for m in macs if cluster.network.tunnel
                and cluster.tunnel_peers(cluster.host(m))]
    if tunneled:
        out.append(f"{', '.join(tunneled)}: macOS hosts get no WireGuard tunnel from meshdeploy "
                   "yet (the wg-quick file and launchd plist are rendered, not installed); "
                   "their peers' tunnels to them stay down")
    if macs:
        return out + [f"{', '.join(macs)}: macOS hosts are not firewalled by meshdeploy yet (the pf "
                "anchor is rendered, not loaded); their rpc-server ports are open to their "
                "network"]
    return out


def allowlist(ctx: HostContext) -> Step:
    """network.allowlist: rpc-server ports open only to their orchestrators, llama-server ports
    to loopback and what the file allows; the whole table replaced atomically (nft -f)."""
    live = ctx.fact("network.Allowlist")
    if ctx.host.rootless:
        # checks.py refused the file unless it acknowledged this (hosts.NAME.unprotected).
        return Step(ctx.change(ROLE, "allowlist", "no-op",
                               "rootless: no allow-list without root" if
                               ctx.cluster.network.firewall else "firewall off"))
    if not ctx.cluster.network.firewall or _darwin(ctx):
        if live is None:
            return Step(ctx.change(ROLE, "allowlist", "no-op",
                                   "firewall off" if not ctx.cluster.network.firewall
                                   else "macOS: not managed yet"))
        return Step(ctx.change(ROLE, "allowlist", "delete", f"{OPT_OUT}: remove the table",
                               rules.diffs({}, live)), rules.remove_commands())
    copiers = tuple(ctx.resolved.value(LLAMA_CPP, "build_copiers", {}).get(ctx.host.name, ()))
    copiers += _copiers_left_out(ctx, live, copiers)
    login_uid = _login_uid(ctx)
    wanted = rules.allowlist(ctx.cluster, ctx.host, copiers, login_uid)
    if not wanted:
        if live is None:
            return Step(ctx.change(ROLE, "allowlist", "no-op", "no meshdeploy port on this host"))
        return Step(ctx.change(ROLE, "allowlist", "delete", "no meshdeploy port on this host",
                               rules.diffs({}, live)), rules.remove_commands())
    if live == wanted:
        ports = ", ".join(sorted(wanted, key=rules.key_order))
        return Step(ctx.change(ROLE, "allowlist", "no-op", f"ports {ports} filtered as wanted"))
    install = [] if "nft" in (ctx.fact("network.Tools") or []) else [_installer(ctx)]
    return Step(ctx.change(ROLE, "allowlist", "create" if live is None else "update",
                           "not loaded" if live is None else "rules differ (drift or a new peer)",
                           rules.diffs(wanted, live)),
                [c for c in install if c] + rules.apply_commands(
                    rules.nft_file(ctx.cluster, ctx.host, copiers, login_uid)))


def _copiers_left_out(ctx: HostContext, live, copiers: tuple) -> tuple[str, ...]:
    """Hosts outside this run (--limit) that the loaded table lets reach md-share as copiers
    of this host's build: they keep that place. Who copies a build is decided from the probed
    hosts' facts alone (keys.copiers), so a run without them would shut them out, and a later
    run of just those hosts would find the port closed."""
    if not live or ctx.cluster_facts is None:
        return ()
    share = rules.port_key("tcp", model_share_port)
    admitted = list(live.get(share) or ())
    if not admitted:
        return ()
    kept = []
    for h in ctx.cluster.hosts:
        if h.name in ctx.cluster_facts or h.name == ctx.host.name or h.name in copiers:
            continue
        try:
            # nft merges neighbours into networks: compare as sets of addresses, not strings.
            source = rules.share_source(ctx.cluster, ctx.host, h)
            if rules.normalize(admitted + [source]) == rules.normalize(admitted):
                kept.append(h.name)
        except (PlanError, ValueError):
            continue  # no address a rule can hold, or a loaded source that is none
    return tuple(kept)


def _login_uid(ctx: HostContext) -> int | None:
    """The login user's uid (network.SshLogin), which a loopback rpc-server port admits (sshd's
    forwards run as it); a plan that needs it and has none is refused, not guessed."""
    uid = (ctx.fact(ssh_ops.LOGIN_FACT) or {}).get("uid")
    if uid is None and rules.local_ports(ctx.cluster, ctx.host, None):
        raise PlanError(f"{ctx.host.name}: the login user's uid was not read (network.SshLogin), "
                        "and its loopback rpc-server ports admit only root and that user",
                        hint="check that `id -u` works for the login user there, then plan again")
    return uid


# -- WireGuard (network.transport: wireguard) ----------------------------------------------------

WG_OPT_OUT = "network.transport: plain"

def _in_mesh(ctx) -> bool:
    return ctx.cluster.network.tunnel and bool(ctx.cluster.tunnel_peers(ctx.host))


def _wg_missing(ctx) -> list[str]:
    """Packages the host lacks for its tunnel: wireguard-tools, and wireguard-go where the
    kernel has no WireGuard module."""
    fact = ctx.fact("network.WireGuard") or {}
    tools = fact.get("tools") or []
    missing = [] if {"wg", "wg-quick"} <= set(tools) else list(d.network_wg_packages)
    if not fact.get("kernel") and "wireguard-go" not in tools:
        missing += list(d.network_wg_userspace_packages)
    return missing


def _wg_preflight(ctx: HostContext) -> None:
    if not _in_mesh(ctx) or _darwin(ctx):
        return
    missing = _wg_missing(ctx)
    _wg_userspace_packaged(ctx, missing)
    if missing and _installer(ctx, missing) is None:
        raise PlanError(f"{ctx.host.name}: no {' or '.join(missing)} for the WireGuard tunnel, "
                        "and neither apt-get nor dnf to install it",
                        hint=f"install {' '.join(missing)} on the host, or set {WG_OPT_OUT} "
                             "(RPC then travels in clear on the hosts' network)")


def _wg_userspace_packaged(ctx: HostContext, missing: list[str]) -> None:
    """Refuse a host that needs wireguard-go from a release that has no such package."""
    if not set(d.network_wg_userspace_packages) & set(missing):
        return
    platform = ctx.fact("toolchain.Platform") or {}
    distro = platform.get("distro") or ""
    first = d.network_wg_userspace_since.get(distro)
    major = (platform.get("version") or "").split(".")[0]
    if first is None or not major.isdigit() or int(major) >= first:
        return
    raise PlanError(f"{ctx.host.name}: the kernel has no WireGuard module and {distro} {major} "
                    f"has no wireguard-go package (the first with one is {distro} {first})",
                    hint="load the kernel's wireguard module (modprobe wireguard), install "
                         f"wireguard-go on the host yourself, or set {WG_OPT_OUT}")


def wireguard_key(ctx: HostContext) -> Step:
    """network.wireguard_key: the host's WireGuard key pair, generated on the host (with
    wireguard-tools, and wireguard-go where the kernel lacks the module, installed first).
    `-replace=network.wireguard` makes a new pair."""
    if not _in_mesh(ctx):
        return Step(ctx.change(ROLE, "wireguard_key", "no-op", "not in a WireGuard mesh"))
    if _darwin(ctx):
        return Step(ctx.change(ROLE, "wireguard_key", "no-op", "macOS: not managed yet"))
    have = (ctx.fact("network.WireGuard") or {}).get("public_key")
    rotate = ctx.replacing("network.wireguard")
    if have and not rotate:
        return Step(ctx.change(ROLE, "wireguard_key", "no-op",
                               f"key pair present (public key {wgr.fingerprint(have)})"))
    missing = _wg_missing(ctx)
    install = [_installer(ctx, missing)] if missing else []
    cluster = ctx.cluster
    diff = AttrDiff("public key", wgr.fingerprint(have), None, forces_replacement=rotate,
                    known_after_apply=True)
    reason = ("-replace: a new key pair, made on the host (the private key never leaves it)"
              if have else "no key pair yet: generated on the host (the private key never "
              "leaves it)")
    return Step(ctx.change(ROLE, "wireguard_key", "replace" if have else "create", reason,
                           [diff]),
                [c for c in install if c] + [shell.template(
                    rules.TEMPLATES / "wg-genkey.sh", DIR=d.network_wg_key_dir,
                    KEY=wgr.key_file(cluster), IFACE=settings.of(cluster).wireguard.interface)])


def _peer_key(ctx, peer) -> str | None:
    """The peer's public key, or None while it is known only after apply: the peer has none
    yet, or its wireguard_key step makes a new one that has not been re-read."""
    key = (ctx.fact_of(peer.name, "network.WireGuard") or {}).get("public_key")
    key = ssh_ops.settled_key(ctx, peer.name, key, "network.wireguard_key",
                              "network.wireguard", wgr.fingerprint)
    return key if key and wgr.PUBLIC_KEY.fullmatch(key) else None


def _wg_remove(ctx, fact: dict | None, reason: str) -> Step:
    if not fact or not (fact.get("up") or fact.get("conf_sha256") or fact.get("enabled")):
        return Step(ctx.change(ROLE, "wireguard", "no-op", reason))
    unit = wgr.unit(ctx.cluster)
    return Step(ctx.change(ROLE, "wireguard", "delete", f"{reason}: take the tunnel down",
                           [AttrDiff("address", (fact.get("addresses") or [None])[0], None)]),
                [shell.command("systemctl", "disable", "--now", "--quiet", unit, shell.QUIET,
                               shell.THEN, "ip", "link", "delete", "dev",
                               settings.of(ctx.cluster).wireguard.interface, shell.QUIET,
                               shell.THEN, "rm", "-f", wgr.conf_path(ctx.cluster))])


def wireguard(ctx: HostContext) -> Step:
    """network.wireguard: the tunnel interface (wg-quick@<interface>, enabled at boot): the
    host's tunnel address, listen port and exactly its peers (name, tunnel address, public key);
    changed peers or keys are synced into the running interface (`systemctl reload`), a new
    address or port restarts it."""
    cluster = ctx.cluster
    fact = ctx.fact("network.WireGuard")
    if not cluster.network.tunnel:
        return _wg_remove(ctx, fact, "network.transport: plain")
    if not cluster.tunnel_peers(ctx.host):
        return _wg_remove(ctx, fact, "no RPC to or from another host")
    if _darwin(ctx):
        return Step(ctx.change(ROLE, "wireguard", "no-op",
                               "macOS: rendered, not installed (see the plan's warning)"))
    keys = {p.name: _peer_key(ctx, p) for p in cluster.tunnel_peers(ctx.host)}
    want = wgr.wanted(cluster, ctx.host, keys)
    live = wgr.live_view(fact, keys, want["peers"])
    changes = wgr.diffs(want, live)
    fact = fact or {}
    own = _peer_key(ctx, ctx.host)
    rotate = ctx.replacing("network.wireguard")
    if rotate:
        changes.append(AttrDiff("public key", wgr.fingerprint(fact.get("public_key")),
                                None, forces_replacement=True, known_after_apply=True))
    action = "create" if live is None else ("replace" if rotate else "update")
    if own is None or None in keys.values():
        who = sorted([n for n, k in keys.items() if k is None] + ([] if own else ["this host"]))
        return Step(ctx.change(ROLE, "wireguard", action,
                               f"public keys known after apply ({', '.join(who)})", changes))
    text = wgr.conf_file(cluster, ctx.host, keys)
    matches = (want == live and fact.get("conf_sha256") == hashlib.sha256(text.encode()).hexdigest()
               and fact.get("enabled") and fact.get("live_key") == own)
    if matches and not rotate:
        return Step(ctx.change(ROLE, "wireguard", "no-op",
                               f"{settings.of(cluster).wireguard.interface} up with "
                               f"{len(keys)} peer(s) as wanted"))
    unit = wgr.unit(cluster)
    iface = settings.of(cluster).wireguard.interface
    restart = live is None or (want["address"], want["listen_port"]) != (
        live["address"], live["listen_port"]) or fact.get("live_key") != own
    start = shell.command("systemctl", "stop", unit, shell.QUIET, shell.THEN, "ip", "link",
                          "delete", "dev", iface, shell.QUIET, shell.THEN,
                          "systemctl", "start", unit)
    # `wg syncconf` (the unit's reload) applies a file without PrivateKey as "no private key"
    # (seen in the lab: the tunnel went dead after a reload), so the key is set again at once.
    sync = shell.command("systemctl", "reload", unit, shell.AND, "wg", "set", iface,
                         "private-key", wgr.key_file(cluster), shell.OR) + " " + \
        shell.subshell(start)
    reason = ("-replace: peers take the new public keys; no service restarts (the tunnel "
              "keeps its address)" if rotate else
              "no tunnel yet" if live is None else "differs (drift or a new peer)")
    return Step(ctx.change(ROLE, "wireguard", action, reason, changes),
                [shell.write_file(wgr.conf_path(cluster), text, "0600"),
                 shell.command("systemctl", "enable", "--quiet", unit),
                 start if restart else sync,
                 shell.command("wg", "show", iface, "listen-port")])


def destroy(ctx: HostContext, purge: bool) -> Teardown:
    """The allow-list table and its boot unit, the WireGuard tunnel, its file and the host's
    key pair; network.transport: ssh's authorized lines, key pair and known_hosts. The packages
    (nftables, wireguard-tools) stay: they are the host's tools."""
    steps = []
    live = ctx.fact("network.Allowlist")
    if live is not None:
        steps.append(Step(ctx.change(ROLE, "allowlist", "delete", "leaves the cluster",
                                     rules.diffs({}, live)),
                          rules.remove_commands() + [_RMDIRS]))
    fact = ctx.fact("network.WireGuard")
    tunnel = _wg_remove(ctx, fact, "leaves the cluster")
    if not tunnel.noop:
        steps.append(tunnel)
    if (fact or {}).get("public_key"):
        steps.append(Step(ctx.change(ROLE, "wireguard_key", "delete", "leaves the cluster",
                                     [AttrDiff("public key", wgr.fingerprint(fact["public_key"]),
                                               None)]),
                          [shell.command("rm", "-f", wgr.key_file(ctx.cluster)), _RMDIRS]))
    steps += ssh_ops.destroy(ctx)
    return Teardown(tuple(steps))


# meshdeploy's folders under /etc, once empty (another cluster's files keep them).
_ETC = posixpath.dirname(d.network_nft_file)
_RMDIRS = shell.command("rmdir", d.network_wg_key_dir, _ETC, posixpath.dirname(_ETC),
                        shell.QUIET, shell.OR, "true")
