"""network: the keys of network.transport: ssh (pure: model and facts in, lines and plan diffs
out; nothing here talks to a host).

Each orchestrator (cluster.ssh_forwards) has one ed25519 key pair made on it; each worker's login
user authorizes that key for exactly its forward, and the orchestrator pins the worker's host
keys as the probe read them over meshdeploy's own checked connection:

```python
authorized_line(cluster, node1, forward, "ssh-ed25519 AAAA...")
# 'command="false",restrict,port-forwarding,permitopen="127.0.0.1:50052",
#  permitlisten="127.0.0.1:1",from="10.200.0.11" ssh-ed25519 AAAA... meshdeploy-rpc:lab:node1'
# (permitlisten="127.0.0.1:30180" where node1's md-share reaches the worker through it)
known_hosts_line(node2, "ssh-ed25519 AAAA...")      # '10.200.0.12 ssh-ed25519 AAAA...'
```
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import re
import struct

from meshdeploy.core import share
from meshdeploy.errors import PlanError

MARKER = "meshdeploy-rpc:"
# The key types a host's sshd or an authorized line may carry here (what OpenSSH makes by
# default); anything else a host prints is dropped by the facts.
KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521",
             "ssh-rsa")
_B64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
# An address as a known_hosts line or a from= option may hold it (an IP literal or a DNS name).
_HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:-]*")
# A line of ours (or another cluster's) in authorized_keys: options without spaces, a key, and
# the marker as the last field.
_AUTHORIZED = re.compile(r"(?:(?P<options>[!-~]+) )?(?P<key>\S+ \S+) (?P<comment>"
                         + re.escape(MARKER) + r"[A-Za-z0-9_.:@-]{1,200})")
_KNOWN = re.compile(r"(?P<host>\[[A-Za-z0-9.:-]+\]:[0-9]{1,5}|[A-Za-z0-9.:-]+) (?P<key>\S+ \S+)")


def public_key(text: str) -> str | None:
    """`type base64` of an OpenSSH public key line (its comment dropped), or None unless the
    type is one of KEY_TYPES and the base64 decodes to a key blob of that same type."""
    words = text.split()
    if len(words) < 2 or words[0] not in KEY_TYPES or len(words[1]) > 2048 \
            or not _B64.fullmatch(words[1]):
        return None
    try:
        blob = base64.b64decode(words[1], validate=True)
        (size,) = struct.unpack(">I", blob[:4])
    except (binascii.Error, ValueError, struct.error):
        return None
    if blob[4:4 + size] != words[0].encode() or len(blob) <= 4 + size:
        return None
    if words[0] == "ssh-ed25519" and len(blob) != 4 + size + 4 + 32:
        return None  # an ed25519 key is exactly its 32 bytes after the type
    return f"{words[0]} {words[1]}"


def fingerprint(key: str | None) -> str | None:
    """The key as `ssh-keygen -l` names it: SHA256:<base64 of the blob's sha256, no padding>."""
    if key is None:
        return None
    digest = hashlib.sha256(base64.b64decode(key.split()[1])).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def cluster_marker(cluster) -> str:
    """The comment prefix of this cluster's lines: other clusters' and the user's own lines
    never start with it."""
    return f"{MARKER}{cluster.name}:"


def source_address(cluster, orchestrator) -> str:
    """The IP address `orchestrator`'s forwards log in to a worker from (from=, sshd's Match)."""
    return _source(cluster, orchestrator)


def _source(cluster, orchestrator) -> str:
    address = cluster.source_address(orchestrator)
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        raise PlanError(
            f"hosts.{orchestrator.name}.address is {address!r}, a DNS name; the ssh key a worker "
            "authorizes for it is limited with from=, which sshd matches against the address "
            "the connection comes from (a name only with UseDNS, off by default)",
            hint=f"give hosts.{orchestrator.name}.address as the IP address it connects "
                 "from") from None


def authorized_line(cluster, orchestrator, forward, key: str) -> str:
    """The worker's authorized_keys line for `orchestrator`'s forward: a forced command that
    runs nothing, no pty/agent/X11 (restrict), port forwarding to exactly the forward's rpc
    ports on the worker's loopback, from the orchestrator's address only. command="false", not
    /bin/false: Termux has no /bin, and sshd runs a forced command with the user's shell."""
    if public_key(key) != key:
        raise PlanError(f"{orchestrator.name}: {key[:40]!r} is not an ssh public key")
    opens = ",".join(f'permitopen="127.0.0.1:{int(remote)}"' for _, remote in forward.ports)
    # port-forwarding turns remote (-R) forwards back on too, and permitopen does not limit
    # them: permitlisten names the one loopback port where the forward's reverse end carries
    # the orchestrator's md-share to this worker (share.reverse_port), or port 1, which only
    # root can bind: that refuses every TCP listener (sshd rejects the whole line for
    # permitlisten="none"). Unix-socket listeners cannot be refused from this file (only
    # sshd_config's AllowStreamLocalForwarding can).
    reverse = share.reverse_port(cluster, orchestrator.name, forward.worker.name)
    listen = f"127.0.0.1:{int(reverse) if reverse else 1}"
    return (f'command="false",restrict,port-forwarding,{opens},permitlisten="{listen}",'
            f'from="{_source(cluster, orchestrator)}" {key} '
            f"{cluster_marker(cluster)}{orchestrator.name}")


def known_hosts_host(worker) -> str:
    """How the forward names the worker (-p PORT ADDR) in known_hosts: ADDR, or [ADDR]:PORT."""
    address = worker.address
    if not _HOSTNAME.fullmatch(address):
        raise PlanError(f"hosts.{worker.name}.address {address!r} cannot be written into a "
                        "known_hosts file", hint="use a plain IP address or host name")
    port = int(worker.ssh.port)
    return address if port == 22 else f"[{address}]:{port}"


def known_hosts_lines(workers_keys: list[tuple[object, list[str]]]) -> list[str]:
    """One line per (worker, host key), workers in forward order, keys sorted."""
    return [f"{known_hosts_host(w)} {k}" for w, keys in workers_keys for k in sorted(keys)]


def parse_authorized(line: str) -> tuple[str, str] | None:
    """(comment, line) of a marker line whose key parses (type, base64), else None."""
    m = _AUTHORIZED.fullmatch(line)
    if m is None or public_key(m.group("key")) != m.group("key"):
        return None
    return m.group("comment"), line


def parse_known(line: str) -> str | None:
    """A known_hosts line in the form known_hosts_lines() writes, else None."""
    m = _KNOWN.fullmatch(line)
    if m is None or public_key(m.group("key")) != m.group("key"):
        return None
    return line


def shown_line(line: str | None) -> str | None:
    """What a plan shows of an authorized line: where it may forward, from where, whose key
    (its fingerprint)."""
    if line is None:
        return None
    parsed = _AUTHORIZED.fullmatch(line)
    if parsed is None:
        return "unreadable line"
    options = parsed.group("options") or ""
    opens = re.findall(r'permitopen="([^"]*)"', options)
    source = re.findall(r'from="([^"]*)"', options)
    listens = [p for p in re.findall(r'permitlisten="([^"]*)"', options) if p != "127.0.0.1:1"]
    back = f", back to {', '.join(listens)}" if listens else ""
    return (f"forwards {', '.join(opens) or 'nothing'}{back} from "
            f"{', '.join(source) or 'anywhere'}, key {fingerprint(parsed.group('key'))}")
