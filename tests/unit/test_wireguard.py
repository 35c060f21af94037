"""network.transport: wireguard without hosts: addressing, the rendered wg-quick file (no private
key), the macOS plist, the allow-list it implies, the nft table read back, and -replace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import golden

from meshdeploy.cli import build_parser
from meshdeploy.core.loading import load_cluster
from meshdeploy.roles.network.settings import derived_tunnel_address
from meshdeploy.engine.planner import check_replace
from meshdeploy.errors import ConfigError, PlanError
from meshdeploy.roles.network import facts, rules
from meshdeploy.roles.network import tunnel as wg

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
WG_LAB = ROOT / "inventories" / "lab-wireguard.yaml"
GOLDEN = TESTS / "golden" / "wireguard"
KEYS = {"node1": "yAnz5TF+lXXJte14tji3zlMNq+hd2rYUIgJBgB3fBmk=",
        "node2": "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg=",
        "node3": "TrMvSoP4jYQlY6RIzBgbssQqY3vxI2Pi+y71lOWWXX0="}


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(WG_LAB)


def edited(tmp_path, edit) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(edit(WG_LAB.read_text()))
    return path


def test_tunnel_addresses_depend_on_the_name_only(cluster):
    wgc = cluster.network.wireguard
    assert wgc.subnet == "10.99.0.0/16" and wgc.listen_port == 51820
    addresses = {h.name: wgc.address(h.name) for h in cluster.hosts}
    assert len(set(addresses.values())) == 3
    # Adding or removing hosts never moves one: the address is a function of (subnet, name).
    assert addresses["node2"] == derived_tunnel_address("10.99.0.0/16", "node2")
    for address in addresses.values():
        assert address.startswith("10.99.") and address not in ("10.99.0.0", "10.99.255.255")


def test_workers_bind_the_tunnel_and_the_orchestrator_dials_it(cluster):
    node2 = cluster.host("node2")
    assert node2.rpc_servers[0].bind == cluster.network.wireguard.address("node2")
    targets = [e.target for e in cluster.rpc_endpoints(cluster.server("main"))]
    assert targets == [f"{cluster.network.wireguard.address(n)}:50052" for n in ("node2", "node3")]
    assert [h.name for h in cluster.tunnel_peers(cluster.host("node1"))] == ["node2", "node3"]
    assert [h.name for h in cluster.tunnel_peers(node2)] == ["node1"]  # never worker-worker


def test_an_rpc_server_only_its_own_host_uses_binds_loopback(tmp_path):
    path = edited(tmp_path, lambda t: t.replace("    ctx_size: 2048\n",
                                                "    ctx_size: 2048\n    rpc: [node2:50052]\n"))
    cluster = load_cluster(path)
    assert cluster.host("node3").rpc_servers[0].bind == "127.0.0.1"
    assert cluster.tunnel_peers(cluster.host("node3")) == []


def test_a_worker_left_out_leaves_the_orchestrators_udp_allowlist(cluster, tmp_path):
    # node2 and node3, merged the way nft merges set elements.
    assert rules.allowlist(cluster, cluster.host("node1"))["udp/51820"] == ["10.200.0.12/31"]
    fewer = load_cluster(edited(tmp_path, lambda t: t.replace(
        "    ctx_size: 2048\n", "    ctx_size: 2048\n    rpc: [node2:50052]\n")))
    assert rules.allowlist(fewer, fewer.host("node1"))["udp/51820"] == ["10.200.0.12"]
    assert "udp/51820" not in rules.allowlist(fewer, fewer.host("node3"))


def test_the_allowlist_opens_rpc_on_the_tunnel_and_udp_to_peers_only(cluster):
    orchestrator = cluster.network.wireguard.address("node1")
    assert rules.allowlist(cluster, cluster.host("node2")) == {
        "50052": ["lo", f"{orchestrator} via mdwg0"], "udp/51820": ["10.200.0.11"]}
    text = rules.nft_file(cluster, cluster.host("node2"))
    assert f'tcp dport 50052 iifname "mdwg0" ip saddr {{ {orchestrator} }} accept' in text
    assert "udp dport 51820 ip saddr { 10.200.0.11 } accept" in text


def test_the_loaded_table_reads_back_as_the_wish(cluster):
    """What `nft -j list table` prints for the rendered table (its JSON shape, written out)."""
    orchestrator = cluster.network.wireguard.address("node1")

    def rule(*expr):
        return {"rule": {"family": "inet", "table": "meshdeploy", "chain": "input", "handle": 3,
                         "expr": list(expr)}}

    def dport(proto, port):
        return {"match": {"op": "==", "left": {"payload": {"protocol": proto, "field": "dport"}},
                          "right": port}}
    iif = {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "mdwg0"}}
    lo = {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "lo"}}

    def saddr(a):
        return {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                          "right": a}}
    items = [{"chain": {"name": "input", "type": "filter", "hook": "input", "policy": "accept"}},
             rule(dport("tcp", 50052), lo, {"accept": None}),
             rule(dport("tcp", 50052), iif, saddr(orchestrator), {"accept": None}),
             rule(dport("tcp", 50052), {"counter": {}}, {"drop": None}),
             rule(dport("udp", 51820), saddr("10.200.0.11"), {"accept": None}),
             rule(dport("udp", 51820), {"counter": {}}, {"drop": None})]
    assert facts.read_table(items) == rules.allowlist(cluster, cluster.host("node2"))
    # The same address accepted from any interface is not the wish: the plan shows it.
    items[2] = rule(dport("tcp", 50052), saddr(orchestrator), {"accept": None})
    assert facts.read_table(items) != rules.allowlist(cluster, cluster.host("node2"))


def test_the_wg_quick_file_golden_has_no_private_key(cluster):
    text = "".join(f"## {h}\n" + wg.conf_file(cluster, cluster.host(h), KEYS)
                   for h in ("node1", "node2"))
    golden.check(GOLDEN / "lab-wireguard.conf.txt", text)
    assert "PrivateKey" not in text and "PostUp = wg set %i private-key " in text


def test_the_macos_launchd_plist_golden(cluster):
    golden.check(GOLDEN / "lab-wireguard.plist", wg.launchd_plist(cluster))


def test_the_plist_refuses_what_xml_cannot_carry(cluster):
    """The schema keeps control characters out of the interface name; a cluster built in code
    meets the same refusal as the services' plists (core.units.plist), naming the setting."""
    import dataclasses

    network = dataclasses.replace(cluster.network, wireguard=dataclasses.replace(
        cluster.network.wireguard, interface="mdwg\x01"))
    with pytest.raises(PlanError, match="network.wireguard.interface: .*control character"):
        wg.launchd_plist(dataclasses.replace(cluster, network=network))


def test_a_public_key_that_is_not_one_never_reaches_the_file(cluster):
    with pytest.raises(PlanError, match="not a WireGuard public key"):
        wg.conf_file(cluster, cluster.host("node2"), {"node1": "x\nPrivateKey = y"})


def test_plan_diffs_name_peers_by_fingerprint_and_key_known_after_apply(cluster):
    host = cluster.host("node1")
    want = wg.wanted(cluster, host, {"node2": KEYS["node2"], "node3": None})
    shown = {d.name: d for d in wg.diffs(want, None)}
    assert shown["peer node2"].after.endswith(f"key {wg.fingerprint(KEYS['node2'])}")
    assert KEYS["node2"] not in json.dumps([vars(d) for d in shown.values()])
    assert shown["peer node3"].known_after_apply


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("  transport: wireguard", "  transport: wireguard\n  wireguard:\n"
                         "    subnet: 10.99.0.1/16"), "network.wireguard.subnet: '10.99.0.1/16' "
                                                      "is not an IPv4 network"),
    (lambda t: t.replace("  transport: wireguard", "  transport: wireguard\n  wireguard:\n"
                         "    addresses: {node9: 10.99.0.5}"), "no host named 'node9'"),
    (lambda t: t.replace("  transport: wireguard", "  transport: wireguard\n  wireguard:\n"
                         "    addresses: {node2: 10.98.0.5}"), "10.98.0.5 is not a host address"),
    (lambda t: t.replace("  transport: wireguard", "  transport: wireguard\n  wireguard:\n"
                         "    subnet: 10.99.0.0/30"), "the same tunnel address"),
    (lambda t: t.replace("  transport: wireguard", "  transport: wireguard\n  wireguard:\n"
                         "    listen_port: 70000"), "70000 is out of range"),
    (lambda t: t.replace("  transport: wireguard", "  transport: wireguird"), "transport"),
])
def test_bad_wireguard_settings_are_one_error_at_file_line(tmp_path, edit, message):
    with pytest.raises(ConfigError) as info:
        load_cluster(edited(tmp_path, edit))
    text = str(info.value)
    assert "cluster.yaml:" in text and message in text, text


def test_an_explicit_address_wins(tmp_path):
    cluster = load_cluster(edited(tmp_path, lambda t: t.replace(
        "  transport: wireguard", "  transport: wireguard\n  wireguard:\n"
        "    addresses: {node2: 10.99.0.2}")))
    assert cluster.network.wireguard.address("node2") == "10.99.0.2"
    assert cluster.host("node2").rpc_servers[0].bind == "10.99.0.2"


def test_replace_takes_resource_addresses_and_refuses_others(cluster):
    args = build_parser().parse_args(["plan", str(WG_LAB), "-replace=network.wireguard",
                                      "-replace=node2/network.wireguard"])
    assert args.replace == ["network.wireguard", "node2/network.wireguard"]
    assert check_replace(cluster, args.replace) == tuple(args.replace)
    with pytest.raises(PlanError, match="no such resource address"):
        check_replace(cluster, ["node9/network.wireguard"])
    with pytest.raises(PlanError, match="network.wireguar: no such|no such resource"):
        check_replace(cluster, ["network.wireguar"])
    with pytest.raises(PlanError, match="llama_cpp.source cannot be replaced") as info:
        check_replace(cluster, ["llama_cpp.source"])
    assert "network.wireguard" in info.value.hint


def test_units_that_use_the_tunnel_start_after_it(cluster):
    """Boot order: rpc-server binds a tunnel address and llama-server dials them; neither exists
    before wg-quick@<interface> made the interface, so both are ordered after it (and pull it
    in). The plain lab's units have no such line."""
    from meshdeploy.roles.services import operations as services
    from meshdeploy.roles.services import unit_files

    after = "After=wg-quick@mdwg0.service\nWants=wg-quick@mdwg0.service\n"
    node2 = cluster.host("node2")
    server = cluster.server("main")
    assert after in services.rpc_unit(cluster, node2, node2.rpc_servers[0], "/opt/b",
                                      "ggml-rpc-server")
    assert after in unit_files.server_unit(cluster, cluster.host("node1"), server, "/opt/b",
                                           None, None)
    plain = load_cluster(ROOT / "inventories" / "lab.yaml")
    p2 = plain.host("node2")
    assert "wg-quick" not in services.rpc_unit(plain, p2, p2.rpc_servers[0], "/opt/b",
                                               "ggml-rpc-server")


def test_a_unit_name_that_cannot_be_one_is_refused_not_written():
    from meshdeploy.core.units import ordered_after

    assert ordered_after("wg-quick@wg1", "x") == ("After=wg-quick@wg1.service\n"
                                                  "Wants=wg-quick@wg1.service\n")
    for bad in ("wg-quick@a\nExecStartPre=/bin/sh", "wg quick@x", "/etc/x"):
        with pytest.raises(PlanError):
            ordered_after(bad, "network.wireguard.interface")
