"""Lab networking: one lab namespace holding the bridge, one namespace per host.

Every lab address lives inside namespaces created here; the machine's own namespace never gets
a lab address, route or interface, so the lab cannot leak traffic onto real networks.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess

from meshdeploy.lab.errors import LabError

SUBNET = ipaddress.ip_network("10.200.0.0/24")
BRIDGE_ADDRESS = "10.200.0.1"
FIRST_HOST_OCTET = 11
MAX_HOSTS = 200
BRIDGE = "mdlab-br"
NAME_RE = re.compile(r"^[a-z][a-z0-9]{1,9}$")


def check_name(name: str) -> str:
    # Interface and namespace names are derived from it and Linux caps interface names at 15.
    if not NAME_RE.match(name):
        raise LabError(
            f"lab name {name!r} is invalid: use 2-10 lowercase letters/digits starting with a "
            "letter (e.g. mdlab)"
        )
    return name


def host_names(count: int) -> list[str]:
    if not 1 <= count <= MAX_HOSTS:
        raise LabError(f"--hosts must be between 1 and {MAX_HOSTS}, got {count}")
    return [f"node{i}" for i in range(1, count + 1)]


def host_address(host: str) -> str:
    index = int(host.removeprefix("node"))
    return str(SUBNET.network_address + FIRST_HOST_OCTET - 1 + index)


def host_netns(lab: str, host: str) -> str:
    return f"{lab}-{host}"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise LabError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc


def list_netns() -> list[str]:
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def lab_netns_names(lab: str) -> list[str]:
    """Every namespace that belongs to lab `lab`, found by name so leftovers are found too."""
    return [ns for ns in list_netns() if ns == lab or ns.startswith(lab + "-")]


def ensure_lab_netns(lab: str) -> None:
    if lab not in list_netns():
        ip("netns", "add", lab)
    ip("-n", lab, "link", "set", "lo", "up")
    if ip("-n", lab, "link", "show", BRIDGE, check=False).returncode != 0:
        ip("-n", lab, "link", "add", BRIDGE, "type", "bridge")
    addrs = ip("-n", lab, "-4", "addr", "show", "dev", BRIDGE).stdout
    if f"inet {BRIDGE_ADDRESS}/" not in addrs:
        ip("-n", lab, "addr", "add", f"{BRIDGE_ADDRESS}/{SUBNET.prefixlen}", "dev", BRIDGE)
    ip("-n", lab, "link", "set", BRIDGE, "up")


def ensure_host_netns(lab: str, host: str) -> str:
    """Create the host's namespace wired to the bridge by a veth pair; returns its name."""
    ns = host_netns(lab, host)
    if ns not in list_netns():
        ip("netns", "add", ns)
    ip("-n", ns, "link", "set", "lo", "up")
    peer = f"v-{host}"
    if ip("-n", ns, "link", "show", "eth0", check=False).returncode != 0:
        ip("-n", lab, "link", "del", peer, check=False)
        ip("-n", lab, "link", "add", peer, "type", "veth", "peer", "name", "eth0", "netns", ns)
    ip("-n", lab, "link", "set", peer, "master", BRIDGE)
    ip("-n", lab, "link", "set", peer, "up")
    address = host_address(host)
    if f"inet {address}/" not in ip("-n", ns, "-4", "addr", "show", "dev", "eth0").stdout:
        ip("-n", ns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
    ip("-n", ns, "link", "set", "eth0", "up")
    return ns


def delete_netns(ns: str) -> None:
    ip("netns", "del", ns, check=False)


def netns_pids(ns: str) -> list[int]:
    out = ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]
