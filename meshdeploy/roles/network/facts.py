"""Facts of the network role: the live allow-list, and which packet filter the host has."""

from __future__ import annotations

import ipaddress
import json

from pyinfra.api import FactBase

from meshdeploy.deploy import shell
from meshdeploy.roles.network import defaults as d
from meshdeploy.roles.network.rules import LOOPBACK, normalize

_TCP_DPORT = {"payload": {"protocol": "tcp", "field": "dport"}}
_SADDR = {"ip": {"payload": {"protocol": "ip", "field": "saddr"}},
          "ip6": {"payload": {"protocol": "ip6", "field": "saddr"}}}
_IIFNAME = {"meta": {"key": "iifname"}}
_OURS = ("filter", "input", "accept")  # the chain's type, hook and policy as rules.py writes them


class Allowlist(FactBase):
    """table inet meshdeploy as it is loaded, in the shape rules.allowlist() returns.

    ```python
    {"50052": ["lo", "10.200.0.11"], "8080": ["lo"]}
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
        except (ValueError, TypeError, KeyError, AttributeError):
            return {"other": ["`nft -j list table` printed something that is not a ruleset"]}

    @staticmethod
    def default():
        return None


def read_table(items: list) -> dict:
    """The meaning of the table's JSON objects (see Allowlist); pure, for tests too."""
    accepted: dict[int, list[str]] = {}
    dropped: list[int] = []
    other: list[str] = []
    for item in items:
        (kind, body), = item.items()
        if kind in ("metainfo", "table"):
            continue
        if kind == "chain" and body.get("name") == d.network_nft_chain:
            found = (body.get("type"), body.get("hook"), body.get("policy"))
            if found != _OURS:
                other.append("chain {}: type {} hook {} policy {}".format(
                    body.get("name"), *found))
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
    for port in sorted(dropped):
        try:
            out[str(port)] = normalize(accepted.get(port, []))
        except ValueError:
            other.append(f"port {port}: sources {accepted.get(port)} are not addresses")
    if other:
        out["other"] = sorted(other)
    return out


def _rule(expr: list) -> tuple[int, list[str] | None] | None:
    """(port, sources) of an accept rule, (port, None) of a drop; None for any other rule."""
    matches = [e["match"] for e in expr if "match" in e]
    verdicts = [k for e in expr for k in e if k in ("accept", "drop")]
    extra = [e for e in expr if not set(e) & {"match", "accept", "drop", "counter"}]
    if extra or len(verdicts) != 1 or not matches or not _is(matches[0], _TCP_DPORT):
        return None
    port = matches[0]["right"]
    if not isinstance(port, int) or isinstance(port, bool):
        return None
    if verdicts == ["drop"]:
        return (port, None) if len(matches) == 1 else None
    if len(matches) != 2:
        return None
    match = matches[1]
    if _is(match, _IIFNAME) and match["right"] == d.network_loopback_ifaces["nft"]:
        return port, [LOOPBACK]
    for family, left in _SADDR.items():
        if _is(match, left):
            sources = _sources(match["right"], family)
            return None if sources is None else (port, sources)
    return None


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
            elif isinstance(e, dict) and "range" in e:
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
