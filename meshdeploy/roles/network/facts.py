"""Facts of the network role: the live allow-list, which packet filter the host has, the
WireGuard interface, and the keys of network.transport: ssh."""

from __future__ import annotations

import ipaddress
import json
import re

from pyinfra.api import FactBase

from meshdeploy.core import probe, shell
from meshdeploy.roles.network import defaults as d
from meshdeploy.roles.network import ssh as sshk
from meshdeploy.roles.network.rules import (
    LOCAL,
    LOOPBACK,
    TEMPLATES,
    VIA,
    normalize,
    port_key,
    uid_order,
)

_DPORT = {proto: {"payload": {"protocol": proto, "field": "dport"}} for proto in ("tcp", "udp")}
_SADDR = {"ip": {"payload": {"protocol": "ip", "field": "saddr"}},
          "ip6": {"payload": {"protocol": "ip6", "field": "saddr"}}}
_IIFNAME = {"meta": {"key": "iifname"}}
_OURS = ("filter", "input", "accept")  # the chain's type, hook and policy as rules.py writes them
_OURS_OUT = ("filter", "output", "accept")  # the same of the output chain (rules.local_ports)
_OIFNAME = {"meta": {"key": "oifname"}}
_SKUID = {"meta": {"key": "skuid"}}
_CT_STATE = {"ct": {"key": "state"}}


class Allowlist(FactBase):
    """table inet meshdeploy as it is loaded, in the shape rules.allowlist() returns.

    ```python
    {"50052": ["lo", "10.200.0.11"], "8080": ["lo"]}
    {"50052": ["lo", "10.99.149.186 via mdwg0"], "udp/51820": ["10.200.0.11"]}  # WireGuard
    {"loopback/50052": ["uid 0", "uid 1000"]}   # network.transport: ssh, the output chain
    ```
    A port is listed when the table drops it, with the sources accepted before that drop
    ("lo" = arriving on loopback; networks merged as rules.normalize does). Whatever meshdeploy
    never writes (another chain or policy, a hand-added rule, a named set) is listed under
    "other", so a plan shows it as drift. None: there is no such table (never applied, deleted,
    or gone with `nft flush ruleset`), or no nft (or no right to run it) on the host. Run it
    as root (privileged probe section): listing a ruleset needs CAP_NET_ADMIN.
    """

    def command(self):
        return shell.command("nft", "-j", "list", "table", d.network_nft_family,
                             d.network_nft_table)

    def process(self, output):
        try:
            items = json.loads("\n".join(output))["nftables"]
            return read_table(items)
        # RecursionError: JSON nested deeper than the parser's stack (nft never prints that).
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return {"other": ["`nft -j list table` printed something that is not a ruleset"]}

    @staticmethod
    def default():
        return None


def read_table(items: list) -> dict:
    """The meaning of the table's JSON objects (see Allowlist); pure, for tests too."""
    accepted: dict[str, list[str]] = {}
    dropped: list[str] = []
    other: list[str] = []
    for item in items:
        (kind, body), = item.items()
        if kind in ("metainfo", "table"):
            continue
        chains = {d.network_nft_chain: _OURS, d.network_nft_output_chain: _OURS_OUT}
        if kind == "chain" and body.get("name") in chains:
            found = (body.get("type"), body.get("hook"), body.get("policy"))
            if found != chains[body["name"]]:
                other.append("chain {}: type {} hook {} policy {}".format(
                    body.get("name"), *found))
            continue
        if kind == "rule" and body.get("chain") == d.network_nft_output_chain:
            local = _local_rule(body.get("expr") or [])
            if local is None or local[0] in accepted:
                other.append(f"{kind}: {json.dumps(_described(body), sort_keys=True)}")
            else:
                accepted[local[0]] = local[1]
                dropped.append(local[0])
            continue
        rule = _rule(body.get("expr") or []) if kind == "rule" else None
        if rule is None or body.get("chain") != d.network_nft_chain:
            other.append(f"{kind}: {json.dumps(_described(body), sort_keys=True)}")
            continue
        port, sources = rule
        if port in dropped:
            continue  # after the port's drop: never reached
        if sources is None:
            dropped.append(port)
        else:
            accepted.setdefault(port, []).extend(sources)
    out = {}
    for port in sorted(dropped, key=lambda k: (k.partition("/")[2] or k, k)):
        if port.startswith(LOCAL):
            out[port] = accepted[port]
            continue
        try:
            out[port] = normalize(accepted.get(port, []))
        except ValueError:
            other.append(f"port {port}: sources {accepted.get(port)} are not addresses")
    if other:
        out["other"] = sorted(other)
    return out


def _rule(expr: list) -> tuple[str, list[str] | None] | None:
    """(port key, sources) of an accept rule, (port key, None) of a drop; None for any other
    rule. An accept matches loopback, or source addresses optionally on one interface."""
    matches = [e["match"] for e in expr if "match" in e]
    verdicts = [k for e in expr for k in e if k in ("accept", "drop")]
    extra = [e for e in expr if not set(e) & {"match", "accept", "drop", "counter"}]
    protos = [p for p, left in _DPORT.items() if matches and _is(matches[0], left)]
    if extra or len(verdicts) != 1 or not protos:
        return None
    port = matches[0]["right"]
    if not isinstance(port, int) or isinstance(port, bool):
        return None
    key = port_key(protos[0], port)
    if verdicts == ["drop"]:
        return (key, None) if len(matches) == 1 else None
    rest = matches[1:]
    iface = None
    if rest and _is(rest[0], _IIFNAME) and isinstance(rest[0]["right"], str):
        iface, rest = rest[0]["right"], rest[1:]
    if not rest:
        return (key, [LOOPBACK]) if iface == d.network_loopback_ifaces["nft"] else None
    if len(rest) != 1:
        return None
    for family, left in _SADDR.items():
        if _is(rest[0], left):
            sources = _sources(rest[0]["right"], family)
            if sources is None:
                return None
            return key, [s + (f"{VIA}{iface}" if iface else "") for s in sources]
    return None


def _local_rule(expr: list) -> tuple[str, list[str]] | None:
    """("loopback/PORT", the uids it lets through) of an output-chain rule in the form
    rules.nft_table writes (tcp dport, oifname lo, ct state new, meta skuid != a set, drop);
    None otherwise (a rule of another form is replaced)."""
    matches = [e["match"] for e in expr if "match" in e]
    rest = [e for e in expr if "match" not in e and "counter" not in e]
    if len(matches) != 4 or rest != [{"drop": None}] or not _is(matches[0], _DPORT["tcp"]) \
            or not (_is(matches[1], _OIFNAME)
                    and matches[1]["right"] == d.network_loopback_ifaces["nft"]) \
            or not (_is(matches[2], _CT_STATE) and matches[2]["right"] in ("new", ["new"])) \
            or matches[3].get("op") != "!=" or matches[3].get("left") != _SKUID:
        return None
    port = matches[0]["right"]
    right = matches[3]["right"]
    elements = right["set"] if isinstance(right, dict) and "set" in right else [right]
    uids = []
    for e in elements:
        if isinstance(e, int) and not isinstance(e, bool):
            uids.append(f"uid {e}")
        elif isinstance(e, dict) and isinstance(e.get("range"), list) and len(e["range"]) == 2 \
                and all(isinstance(u, int) and not isinstance(u, bool) for u in e["range"]):
            uids.append(f"uid {e['range'][0]}-{e['range'][1]}")
        else:
            return None
    if not isinstance(port, int) or isinstance(port, bool):
        return None
    return f"{LOCAL}{port}", uid_order(uids)


def _is(match: dict, left: dict) -> bool:
    return match.get("op") in ("==", "in") and match.get("left") == left


def _sources(right, family: str) -> list[str] | None:
    """Set elements, prefixes, ranges and single addresses as networks; None when odd."""
    elements = right["set"] if isinstance(right, dict) and "set" in right else [right]
    version = 4 if family == "ip" else 6
    out = []
    try:
        for e in elements:
            if isinstance(e, str):
                nets = [ipaddress.ip_network(e)]
            elif isinstance(e, dict) and "prefix" in e:
                nets = [ipaddress.ip_network(f"{e['prefix']['addr']}/{e['prefix']['len']}")]
            elif isinstance(e, dict) and "range" in e and all(isinstance(a, str)
                                                               for a in e["range"]):
                low, high = (ipaddress.ip_address(a) for a in e["range"])
                nets = list(ipaddress.summarize_address_range(low, high))
            else:
                return None
            if any(n.version != version for n in nets):
                return None
            out += [str(n) for n in nets]
    except (ValueError, TypeError, KeyError):
        return None
    return out


def _described(body: dict) -> dict:
    """An object as a plan shows it: without what every object here shares or nft renumbers."""
    return {k: v for k, v in body.items() if k not in ("handle", "family", "table")}


class Tools(FactBase):
    """The packet filters the host can load rules with, for preflight.

    ```python
    ["nft"]   # Linux with nftables; ["pfctl"] on macOS; [] = neither (a preflight error)
    ```
    sbin directories are searched too: a login user's PATH often lacks them.
    """

    def command(self):
        return ('PATH="$PATH:/usr/sbin:/sbin"; for t in nft pfctl; do '
                'command -v "$t" >/dev/null 2>&1 && echo "$t"; done; true')

    def process(self, output):
        return sorted({line.strip() for line in output} & {"nft", "pfctl"})

    @staticmethod
    def default():
        return []


class WireGuard(FactBase):
    """The host's WireGuard interface as meshdeploy manages it; never its private key.

    ```python
    {"tools": ["wg", "wg-quick", "wireguard-go"], "kernel": False,
     "public_key": "base64 of the key file's public key" | None,   # None: no key generated yet
     "conf_sha256": "hex of /etc/wireguard/<iface>.conf" | None, "enabled": True,
     "up": True, "live_key": "the interface's public key" | None, "listen_port": 51820,
     "addresses": ["10.99.149.186/16"],
     "peers": {"<public key>": {"allowed_ips": "10.99.212.54/32", "endpoint": "10.200.0.12:51820"}}}
    ```
    up False: no such interface (never applied, taken down by hand); the live fields are then
    None/empty. Run as root (privileged section): the key file is root-only. The private key
    is read by `wg pubkey` on the host; only the public key is printed.
    + interface: the interface name; key: the private key file; conf: the wg-quick file
    """

    def command(self, interface, key, conf):
        return shell.template(TEMPLATES / "wg-probe.sh", IFACE=interface, KEY=key, CONF=conf)

    def process(self, output):
        out = {"tools": [], "kernel": False, "public_key": None, "conf_sha256": None,
               "enabled": False, "up": False, "live_key": None, "listen_port": None,
               "addresses": [], "peers": {}}
        for line in output:
            name, _, value = line.strip().partition("=")
            if name == "tools":
                out["tools"] = sorted(value.split())
            elif name in ("kernel", "enabled", "up"):
                out[name] = value == "yes"
            elif name in ("public_key", "conf_sha256", "live_key"):
                out[name] = value or None
            elif name == "listen_port":
                out[name] = probe.uint(value)
            elif name == "address":
                out["addresses"].append(value)
            elif name in ("peer", "endpoint"):
                peer, _, rest = value.partition(" ")
                field = "allowed_ips" if name == "peer" else "endpoint"
                out["peers"].setdefault(peer, {})[field] = " ".join(rest.split())
        return out

    @staticmethod
    def default():
        return None


class SshKey(FactBase):
    """An orchestrator's key pair for its ssh forwards (network.transport: ssh); never the
    private key.

    ```python
    {"tools": ["ssh", "ssh-keygen"], "private": True,
     "public_key": "ssh-ed25519 AAAA...",     # None: no key pair yet (or none that parses)
     "known_hosts": ["10.200.0.12 ssh-ed25519 AAAA...", "<odd line>"] | None}  # None: no file
    ```
    public_key is what `ssh-keygen -y` derives from the private key (the .pub file's line when
    that fails), type and base64 only. A known_hosts line that is not in the form meshdeploy
    writes is "<odd line>", so the plan rewrites the file. Run as root on a host with root
    (privileged section: the folder is root's, 0700); as the login user on a rootless host.
    + key: the private key file (core.paths.ssh_key); known: core.paths.ssh_known_hosts
    """

    def command(self, key, known):
        return shell.template(TEMPLATES / "ssh-key-probe.sh", KEY=key, KNOWN=known)

    def process(self, output):
        out = {"tools": [], "private": False, "public_key": None, "known_hosts": None}
        derived = public = None
        for line in output:
            name, _, value = line.partition("=")
            if name == "tools":
                out["tools"] = sorted({"ssh", "ssh-keygen"} & set(value.split()))
            elif name == "private":
                out["private"] = value.strip() == "yes"
            elif name == "derived":
                derived = sshk.public_key(value)
            elif name == "public":
                public = sshk.public_key(value)
            elif name == "known":
                out["known_hosts"] = []
            elif name == "known_line" and out["known_hosts"] is not None:
                out["known_hosts"].append(sshk.parse_known(value) or ODD_LINE)
        out["public_key"] = derived or public
        return out

    @staticmethod
    def default():
        return None


ODD_LINE = "<odd line>"
_LOGIN = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]{0,63}\$?")


class SshLogin(FactBase):
    """What a worker's login user offers the orchestrators' forwards (network.transport: ssh),
    read as that user over meshdeploy's own checked connection.

    ```python
    {"user": "md",                                   # id -un; None when it is no user name
     "uid": 1000,                                    # id -u; None when it is no number
     "host_keys": ["ssh-ed25519 AAAA...", ...],      # sshd's host keys (type + base64), sorted
     "authorized": ["command=... ssh-ed25519 AAAA... meshdeploy-rpc:lab:node1", ...],
     "unparsed": ["meshdeploy-rpc:lab:node1"],        # marker lines whose key does not parse
     "authorized_link": False,                      # ~/.ssh/authorized_keys is a symbolic link
     "keys_file": ".ssh/authorized_keys .ssh/authorized_keys2"}  # sshd's AuthorizedKeysFile
    ```
    host_keys: /etc/ssh/ssh_host_*_key.pub and, on Termux only (PREFIX ends in
    /com.termux/files/usr, or TERMUX_VERSION is set), $PREFIX/etc/ssh/...; comments dropped,
    key types ssh-ed25519, ecdsa-sha2-* and ssh-rsa whose base64 holds a key of that type;
    anything else is dropped. authorized: the lines whose last field starts with
    "meshdeploy-rpc:" (every cluster's; the resource picks its own). Not privileged: the login
    user's own files. keys_file: the first AuthorizedKeysFile value outside a Match block in
    sshd_config.d/*.conf then sshd_config (Termux: under $PREFIX/etc/ssh), printable ASCII, at
    most 200 characters; None: no such line, or the config is not readable (sshd's default,
    .ssh/authorized_keys, is assumed). None: not read.
    """

    def command(self):
        return shell.template(TEMPLATES / "ssh-login-probe.sh")

    def process(self, output):
        out = {"user": None, "uid": None, "host_keys": [], "authorized": [], "unparsed": [],
               "authorized_link": False, "keys_file": None}
        keys = set()
        for line in output:
            name, _, value = line.partition("=")
            if name == "user":
                out["user"] = value if _LOGIN.fullmatch(value) else None
            elif name == "uid":
                out["uid"] = int(value) if re.fullmatch(r"[0-9]{1,10}", value) and \
                    int(value) < 2**32 - 1 else None
            elif name == "host_key":
                key = sshk.public_key(value)
                if key is not None:
                    keys.add(key)
            elif name == "authorized_link":
                out["authorized_link"] = value == "yes"
            elif name == "keys_file":
                out["keys_file"] = re.sub(r"[^ -~]", "?", value.strip())[:200] or None
            elif name == "authorized":
                parsed = sshk.parse_authorized(value)
                if parsed is not None:
                    out["authorized"].append(value)
                else:
                    # Its last field as the write script sees it (awk's $NF), made safe to
                    # show: a line the plan cannot read still counts as one of the cluster's.
                    last = value.split()[-1] if value.split() else ""
                    if last.startswith(sshk.MARKER):
                        out["unparsed"].append(re.sub(r"[^A-Za-z0-9_.:@-]", "?", last)[:200])
        out["host_keys"] = sorted(keys)
        return out

    @staticmethod
    def default():
        return None


class SshdStreamLocal(FactBase):
    """What a root worker's sshd lets the forwards' logins do with Unix sockets
    (network.transport: ssh), read as root.

    ```python
    {"user": "deploy",                 # the login user (who ran sudo), as sshd matches it
     "content": "# Managed by ..." | None,   # meshdeploy's drop-in (regular file), None: none
     "include": True,                  # sshd_config includes /etc/ssh/sshd_config.d/
     "effective": "no" | "all" | ... | None}  # sshd -T for that user from ADDR; None: no sshd
    ```
    content: the first 4 KiB of the file, made printable ASCII. None (the fact): not read.
    + file: the drop-in's path; address: where the forwards log in from (an orchestrator's)
    """

    def command(self, file, address):
        return shell.template(TEMPLATES / "sshd-probe.sh", FILE=file, ADDR=address)

    def process(self, output):
        out = {"user": None, "content": None, "include": False, "effective": None}
        lines = []
        for line in output:
            name, _, value = line.partition("=")
            if name == "user":
                out["user"] = value if _LOGIN.fullmatch(value) else None
            elif name == "line":
                lines.append(re.sub(r"[^ -~\t]", "?", value))
            elif name == "file":
                out["content"] = "".join(f"{x}\n" for x in lines)
            elif name == "include":
                out["include"] = value == "yes"
            elif name == "effective":
                out["effective"] = value if re.fullmatch(r"[a-z]{1,10}", value) else None
        return out

    @staticmethod
    def default():
        return None
