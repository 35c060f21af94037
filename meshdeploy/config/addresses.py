"""Addresses as the cluster file writes them: binds, loopback, the private ranges."""

from __future__ import annotations

import ipaddress

# A bind on every interface (rpc-server -H, llama-server --host).
WILDCARD = "0.0.0.0"

PRIVATE_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "127.0.0.0/8",
    "fd00::/8"))


def local_address(bind: str) -> str:
    """Where a client on the same host reaches a listener bound to `bind`."""
    return "127.0.0.1" if bind == WILDCARD else bind


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def is_private(address: str) -> bool:
    """Whether `address` is a private or loopback IP literal; a host name counts as public
    (what it resolves to is not known here), and so does the wildcard."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in PRIVATE_NETWORKS if net.version == ip.version)


def is_single_address(value: str) -> bool:
    """Whether an address or network literal names one host (10.0.0.5, 10.0.0.5/32, fd00::5/128)."""
    return ipaddress.ip_network(value, strict=False).num_addresses == 1
