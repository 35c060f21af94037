"""The pf anchor (macOS) under WireGuard: the UDP port filtered as UDP, tunnel-only sources held
to the tunnel's interface, and every line inside the subset of pf.conf(5) that pf.py writes.

No pfctl here (`pfctl -nf` runs on macOS only), so the grammar check is a strict regular
expression per line kind over the subset pf.py emits (comments, one macro per tunnel interface,
const tables of addresses, `block drop in quick` rules), plus the cross-checks pfctl would make
(tables and macros defined before use, addresses and ports valid). It proves the anchor stays
inside that subset; it cannot prove macOS's pfctl accepts the subset, which was written from
pf.conf(5). tests/golden/network/two-macs-wireguard.txt pins the text
(MESHDEPLOY_UPDATE_GOLDEN=1 rewrites it).
"""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

import pytest
from support import golden
from support.accounts import load_inventory

from meshdeploy.core.loading import load_cluster
from meshdeploy.roles.network import pf, rules

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
WG_MACS = TESTS / "data" / "two-macs-wireguard.yaml"
CLUSTERS = [WG_MACS, *sorted((ROOT / "inventories").glob("*.yaml"))]

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ADDR = r"[0-9a-f.:/]+"
_TABLE = re.compile(rf"table <(?P<name>{_NAME})> const \{{ (?P<addrs>{_ADDR}(, {_ADDR})*) \}}")
_MACRO = re.compile(rf'(?P<name>{_NAME}) = "(?P<value>[A-Za-z0-9_.+-]{{1,15}})"')
_BLOCK = re.compile(rf"block drop in quick( on (?P<not>! )?(?P<iface>lo0|\${_NAME}))? "
                    rf"proto (?P<proto>tcp|udp)( from (?P<neg>! )?<(?P<table>{_NAME})>)? "
                    r"to any port (?P<port>[0-9]{1,5})")
_COMMENT = re.compile(r"# [ -~]*")


def check_grammar(text: str) -> list[dict]:
    """The anchor's block rules as dicts; AssertionError at the first line outside the subset."""
    tables, macros, blocks = set(), set(), []
    for number, line in enumerate(text.splitlines(), 1):
        where = f"line {number}: {line!r}"
        if _COMMENT.fullmatch(line):
            continue
        if m := _MACRO.fullmatch(line):
            assert not tables and not blocks, f"{where}: macros come first"
            macros.add(m["name"])
        elif m := _TABLE.fullmatch(line):
            assert not blocks, f"{where}: tables come before rules"
            assert len(m["name"]) < 32, f"{where}: pf table names are 31 characters at most"
            for a in m["addrs"].split(", "):
                ipaddress.ip_network(a)  # ValueError names the address
            tables.add(m["name"])
        elif m := _BLOCK.fullmatch(line):
            assert 1 <= int(m["port"]) <= 65535, where
            assert m["table"] is None or m["table"] in tables, f"{where}: undefined table"
            iface = m["iface"] or ""
            assert not iface.startswith("$") or iface[1:] in macros, f"{where}: undefined macro"
            blocks.append(m.groupdict())
        else:
            raise AssertionError(f"{where}: not in the pf subset pf.py writes")
    return blocks


def macs(cluster):
    return [h for h in cluster.hosts if h.backend == "metal"]


def test_golden_two_macs_under_wireguard():
    cluster = load_cluster(WG_MACS)
    out = [f"# {WG_MACS.name}"]
    for host in macs(cluster):
        out.append(f"## {host.name} (pf anchor) {json.dumps(rules.allowlist(cluster, host))}")
        out.append(pf.anchor_file(cluster, host))
    golden.check(TESTS / "golden" / "network" / "two-macs-wireguard.txt", "\n".join(out) + "\n")


# The clusters with a Mac (the others write no pf anchor); checked to be some, so that the test
# below never passes by finding no host to check.
MAC_CLUSTERS = [p for p in CLUSTERS if macs(load_inventory(p))]


def test_the_mac_clusters_are_found():
    assert WG_MACS in MAC_CLUSTERS and len(MAC_CLUSTERS) >= 2, MAC_CLUSTERS


@pytest.mark.parametrize("path", MAC_CLUSTERS, ids=lambda p: p.stem)
def test_every_mac_anchor_is_in_the_pf_subset_and_filters_each_port_by_its_protocol(path):
    cluster = load_inventory(path)
    assert macs(cluster)
    for host in macs(cluster):
        blocks = check_grammar(pf.anchor_file(cluster, host))
        for port in rules.ports(cluster, host):
            mine = [b for b in blocks if b["port"] == str(port.port)]
            assert mine and {b["proto"] for b in mine} == {port.proto}, (host.name, port)


def test_tunnel_sources_count_only_on_the_tunnel_and_the_udp_port_is_udp():
    cluster = load_cluster(WG_MACS)
    mini = pf.anchor_file(cluster, cluster.host("macmini"))
    orchestrator = cluster.network.wireguard.address("m4max")
    assert " via " not in mini
    assert 'meshdeploy_mdwg0 = "mdwg0"' in mini
    assert f"table <meshdeploy_50052> const {{ {orchestrator} }}" in mini
    assert f"table <meshdeploy_50052_via1> const {{ {orchestrator} }}" in mini
    assert ("block drop in quick on ! $meshdeploy_mdwg0 proto tcp from <meshdeploy_50052_via1> "
            "to any port 50052") in mini
    assert ("block drop in quick proto udp from ! <meshdeploy_udp_51820> to any port 51820"
            in mini)
    assert "table <meshdeploy_udp_51820> const { 192.168.1.20 }" in mini
    # m4max's llama-server reaches its own rpc-server over loopback: its own tunnel address is
    # no source to let in from anywhere else.
    m4max = pf.anchor_file(cluster, cluster.host("m4max"))
    assert orchestrator not in m4max
    assert "block drop in quick on ! lo0 proto tcp to any port 50053" in m4max


def test_the_grammar_check_refuses_what_pf_would():
    good = pf.anchor([rules.Port(50052, ("lo", "10.0.0.1"), "rpc-server")], "h")
    check_grammar(good)
    for bad in (good.replace("10.0.0.1", "10.0.0.1 via mdwg0"),
                good.replace("<meshdeploy_50052> to", "<meshdeploy_9> to"),
                good.replace("proto tcp", "proto sctp"),
                good + "pass in quick on $nope proto tcp to any port 1\n",
                good + "block drop in quick on $nope proto tcp to any port 1\n"):
        with pytest.raises((AssertionError, ValueError)):
            check_grammar(bad)


def test_a_source_allowed_anywhere_needs_no_interface_rule():
    text = pf.anchor([rules.Port(50052, ("lo", "10.0.0.1", "10.0.0.1 via wg0", "10.0.0.2 via wg0",
                                         "10.0.0.9 via wg0"), "rpc-server")], "h",
                     local=("10.0.0.9",))
    check_grammar(text)
    assert "table <meshdeploy_50052> const { 10.0.0.1, 10.0.0.2 }" in text
    assert "table <meshdeploy_50052_via1> const { 10.0.0.2 }" in text
    only_anywhere = pf.anchor([rules.Port(50052, ("lo", "10.0.0.1", "10.0.0.1 via wg0"), "x")], "h")
    assert "via" not in only_anywhere and "$meshdeploy_wg0" not in only_anywhere
