"""network: the WireGuard tunnel between each orchestrator and its workers (pure: model in,
file text and plan diffs out; nothing here talks to a host).

Each host of the mesh (cluster.tunnel_peers: it runs a llama-server that uses another host's
rpc-server, or an rpc-server another host's llama-server uses) gets one interface whose peers
are exactly those hosts: a worker never peers with another worker. The wg-quick file has no
PrivateKey line; its PostUp loads the key from the root-only file apply generated on the host,
so the rendered file, the plan and the probe carry public keys only.

```python
conf_file(cluster, cluster.host("node2"), {"node1": "base64 public key"})
# "[Interface]\\nAddress = 10.99.212.54/16\\n...[Peer]\\n# node1\\nPublicKey = ..."
```
"""

from __future__ import annotations

import hashlib
import ipaddress
import re

from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.units import plist
from meshdeploy.errors import PlanError
from meshdeploy.roles.network import defaults as d
from meshdeploy.roles.network import settings

# A Curve25519 public key as wg prints it: 32 bytes in base64.
PUBLIC_KEY = re.compile(r"[A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=")
# What a wg-quick file line cannot carry (a newline would start a new setting, `#` a comment).
_CONF_UNSAFE = re.compile(r"[\s#=\\\"']")


def key_file(cluster) -> str:
    return f"{d.network_wg_key_dir}/{settings.of(cluster).wireguard.interface}.key"


def conf_path(cluster) -> str:
    return f"{d.network_wg_conf_dir}/{settings.of(cluster).wireguard.interface}.conf"


def unit(cluster) -> str:
    return settings.of(cluster).wireguard.unit


def prefix_len(cluster) -> int:
    return ipaddress.IPv4Network(settings.of(cluster).wireguard.subnet).prefixlen


def fingerprint(public_key: str | None) -> str | None:
    """What a plan shows of a public key: its first 8 base64 characters and a hash of it."""
    if public_key is None:
        return None
    return f"{public_key[:8]}…{hashlib.sha256(public_key.encode()).hexdigest()[:6]}"


def _conf_value(value: str, setting: str) -> str:
    if _CONF_UNSAFE.search(value):
        raise PlanError(f"{setting}: {value!r} cannot be written into a wg-quick file",
                        hint="use a plain IP address or host name")
    return value


def conf_file(cluster, host, keys: dict[str, str]) -> str:
    """/etc/wireguard/<interface>.conf for `host`; keys: peer name -> its public key (every
    peer must be there). No PrivateKey: PostUp loads it from the host's own key file."""
    wg = settings.of(cluster).wireguard
    lines = [f"# meshdeploy: WireGuard interface of {host.name} (cluster {cluster.name}). "
             "Generated; the next apply replaces it.",
             "# No private key here: PostUp loads it from a root-only file on this host.",
             "[Interface]",
             f"Address = {wg.address(host.name)}/{prefix_len(cluster)}",
             f"ListenPort = {int(wg.listen_port)}",
             f"PostUp = wg set %i private-key {key_file(cluster)}"]
    for peer in cluster.tunnel_peers(host):
        key = keys[peer.name]
        if not PUBLIC_KEY.fullmatch(key):
            raise PlanError(f"{peer.name}: {key!r} is not a WireGuard public key")
        endpoint = _conf_value(peer.address, f"hosts.{peer.name}.address")
        if ":" in endpoint:
            endpoint = f"[{endpoint}]"
        lines += ["", "[Peer]", f"# {peer.name}", f"PublicKey = {key}",
                  f"AllowedIPs = {wg.address(peer.name)}/32",
                  f"Endpoint = {endpoint}:{int(wg.listen_port)}"]
    return "\n".join(lines) + "\n"


def wanted(cluster, host, keys: dict[str, str | None]) -> dict:
    """The interface as facts.WireGuard reads it back once applied (for the no-op check); a peer
    whose key is None is known after apply."""
    wg = settings.of(cluster).wireguard
    return {"address": f"{wg.address(host.name)}/{prefix_len(cluster)}",
            "listen_port": int(wg.listen_port),
            "peers": {p.name: (keys.get(p.name), f"{wg.address(p.name)}/32")
                      for p in cluster.tunnel_peers(host)}}


def live_view(fact: dict | None, keys: dict[str, str | None],
              want_peers: dict | None = None) -> dict | None:
    """facts.WireGuard in wanted()'s shape: peers named by whose key they carry (a key nobody
    in the file has shows as "unknown <fingerprint>")."""
    if not fact or not fact.get("up"):
        return None
    names = {k: n for n, k in keys.items() if k}
    # A peer whose new key is not known yet is still recognised by its tunnel address.
    by_address = {allowed: n for n, (k, allowed) in (want_peers or {}).items() if k is None}
    peers = {}
    for key, info in (fact.get("peers") or {}).items():
        name = names.get(key) or by_address.get(info.get("allowed_ips")) or \
            f"unknown {fingerprint(key)}"
        peers[name] = (key, info.get("allowed_ips"))
    addresses = fact.get("addresses") or []
    return {"address": addresses[0] if len(addresses) == 1 else " ".join(addresses) or None,
            "listen_port": fact.get("listen_port"), "peers": peers}


def diffs(want: dict, live: dict | None) -> list[AttrDiff]:
    """address, listen_port and one `peer <name>` line per peer: tunnel address and key
    fingerprint (never more of a key; a private key is never read)."""
    live = live or {"address": None, "listen_port": None, "peers": {}}
    out = []
    for name in ("address", "listen_port"):
        if want[name] != live[name]:
            out.append(AttrDiff(name, live[name], want[name]))
    for peer in sorted(set(want["peers"]) | set(live["peers"])):
        after, before = want["peers"].get(peer), live["peers"].get(peer)
        if after is not None and after[0] is None:
            out.append(AttrDiff(f"peer {peer}", _shown(before), f"{after[1]} key (known after "
                                "apply)", known_after_apply=True))
        elif after != before:
            out.append(AttrDiff(f"peer {peer}", _shown(before), _shown(after)))
    return out


def _shown(peer: tuple | None) -> str | None:
    if peer is None:
        return None
    key, allowed = peer
    return f"{allowed} key {fingerprint(key)}"


def launchd_label(cluster) -> str:
    return f"{d.network_wg_launchd_label}.{settings.of(cluster).wireguard.interface}"


def launchd_plist(cluster) -> str:
    """macOS: a LaunchDaemon that brings the interface up at boot with Homebrew's wg-quick
    (which starts wireguard-go on a utun device: macOS has no kernel WireGuard). Rendered and
    golden-tested only; every plan warns that a Mac's tunnel is not set up."""
    brew = d.network_wg_brew_prefix
    iface = settings.of(cluster).wireguard.interface
    doc = {"Label": launchd_label(cluster),
           "ProgramArguments": [f"{brew}/bin/wg-quick", "up",
                                f"{brew}/etc/wireguard/{iface}.conf"],
           "EnvironmentVariables": {"PATH": f"{brew}/bin:/usr/bin:/bin:/usr/sbin:/sbin"},
           "RunAtLoad": True, "KeepAlive": False,
           "StandardErrorPath": f"/var/log/meshdeploy-wireguard-{iface}.log"}
    return plist(doc, "network.wireguard.interface")
