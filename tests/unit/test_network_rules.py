"""The network role's pure parts: the allow-list, its nftables table and pf anchor, the fact.

Rendered tables are checked by nft itself (`nft -c -f`) and loaded for real, then read back
through the fact, inside a throwaway network namespace (`unshare -n`): never the machine's own
ruleset. Goldens in tests/golden/network/ pin what every example inventory's hosts would load
(MESHDEPLOY_UPDATE_GOLDEN=1 rewrites them). The facts' data cases are in tests/fixture/facts/ with every
other role's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support import golden
from support.accounts import load_inventory
from support.require import unmet

from meshdeploy.core.loading import load_cluster
from meshdeploy.errors import PlanError
from meshdeploy.roles.network import facts, pf, rules

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
INVENTORIES = sorted((ROOT / "inventories").glob("*.yaml"))
GOLDEN = TESTS / "golden" / "network"
LAB = ROOT / "inventories" / "lab.yaml"


@pytest.fixture(scope="module")
def lab():
    return load_cluster(LAB)


def cluster_with(tmp_path, edit) -> object:
    text = edit(LAB.read_text())
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return load_cluster(path)


# -- the allow-list ------------------------------------------------------------------------------

def test_lab_allowlist_lets_only_the_orchestrator_reach_each_worker(lab):
    assert rules.allowlist(lab, lab.host("node1")) == {"8080": ["lo"]}
    assert rules.allowlist(lab, lab.host("node2")) == {"50052": ["lo", "10.200.0.11"]}
    assert rules.allowlist(lab, lab.host("node3")) == {"50052": ["lo", "10.200.0.11"]}


def test_an_rpc_server_no_llama_server_uses_is_loopback_only(tmp_path):
    # main uses node2 only: node3's worker is used by nobody, so nobody but node3 may reach it.
    cluster = cluster_with(tmp_path, lambda t: t.replace(
        "    ctx_size: 2048\n", "    ctx_size: 2048\n    rpc: [node2:50052]\n"))
    assert rules.allowlist(cluster, cluster.host("node2")) == {"50052": ["lo", "10.200.0.11"]}
    assert rules.allowlist(cluster, cluster.host("node3")) == {"50052": ["lo"]}


def with_allow(tmp_path, items: str):
    return cluster_with(tmp_path, lambda t: t.replace(
        "    ctx_size: 2048\n", f"    ctx_size: 2048\n    allow: {items}\n"))


def test_server_allow_adds_sources_to_the_llama_server_port_only(tmp_path):
    cluster = with_allow(tmp_path, "[192.168.7.9, 10.0.0.0/24, 'fd00::/64', 10.0.0.7]")
    assert cluster.server("main").allow == ("192.168.7.9", "10.0.0.0/24", "fd00::/64",
                                            "10.0.0.7")
    assert rules.allowlist(cluster, cluster.host("node1")) == {
        "8080": ["lo", "10.0.0.0/24", "192.168.7.9", "fd00::/64"]}
    assert rules.allowlist(cluster, cluster.host("node2")) == {"50052": ["lo", "10.200.0.11"]}


@pytest.mark.parametrize("bad,message", [
    ("10.0.0.1/8", "has host bits set"), ("example.com", "is not an IP address or network"),
    ("10.0.0.300", "is not an IP address or network")])
def test_a_bad_allow_entry_is_a_config_error_at_its_line(tmp_path, bad, message):
    from meshdeploy.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        with_allow(tmp_path, f"[10.0.0.5, '{bad}']")
    [issue] = info.value.issues
    assert issue.path == "servers.main.allow[1]" and message in issue.message
    # The line the test's edit added to the lab's file (counted, not written down: the file
    # grows), the item's column on it.
    line = next(i for i, text in enumerate(
        (tmp_path / "cluster.yaml").read_text().splitlines(), 1)
        if text.startswith("    allow: [10.0.0.5"))
    assert (issue.line, issue.col) == (line, 23)


def test_an_orchestrator_known_by_dns_name_cannot_be_allowed(tmp_path):
    cluster = cluster_with(tmp_path, lambda t: t.replace("address: 10.200.0.11",
                                                         "address: node1.lab.example"))
    with pytest.raises(PlanError, match=r"hosts\.node2\.rpc_servers\[50052\]: .*DNS name") as info:
        rules.allowlist(cluster, cluster.host("node2"))
    assert "hosts.node1.address" in info.value.hint
    assert rules.allowlist(cluster, cluster.host("node1")) == {"8080": ["lo"]}


def test_normalize_merges_like_nft_and_orders_loopback_v4_v6():
    assert rules.normalize(["fd00::1", "10.0.0.9", "lo", "10.0.0.0/8", "10.0.0.9"]) == [
        "lo", "10.0.0.0/8", "fd00::1"]
    assert rules.normalize(["10.0.0.1", "10.0.0.0"]) == ["10.0.0.0/31"]
    assert rules.normalize([]) == []
    with pytest.raises(ValueError):
        rules.normalize(["eth0"])


def test_diffs_name_each_port_whose_sources_changed():
    wanted = {"50052": ["lo", "10.200.0.11"], "8080": ["lo"]}
    assert rules.diffs(wanted, wanted) == []
    live = {"50052": ["lo", "10.200.0.11", "10.200.0.14"], "other": ["rule: {...}"]}
    got = [(d.name, d.before, d.after) for d in rules.diffs(wanted, live)]
    assert got == [("tcp/8080", None, "lo"),
                   ("tcp/50052", "lo 10.200.0.11 10.200.0.14", "lo 10.200.0.11"),
                   ("other", "rule: {...}", None)]
    assert [d.name for d in rules.diffs(wanted, None)] == ["tcp/8080", "tcp/50052"]


# -- what hosts run ------------------------------------------------------------------------------

def test_the_file_replaces_only_its_own_table(lab):
    text = rules.nft_file(lab, lab.host("node2"))
    lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert lines[:3] == ["table inet meshdeploy {}", "delete table inet meshdeploy",
                         "table inet meshdeploy {"]
    assert "flush" not in text and text.count("table ") == 3
    assert "policy accept;" in text
    # Every accept is followed, for its port, by the drop that makes it an allow-list.
    assert text.index('tcp dport 50052 ip saddr { 10.200.0.11 } accept') < text.index(
        "tcp dport 50052 counter drop")


def test_apply_loads_before_it_keeps_the_file_for_boot():
    write, load, unit, enable = rules.apply_commands("table inet meshdeploy {}\n")
    assert "/etc/meshdeploy/network/meshdeploy.nft.new" in write
    assert load == ("nft -f /etc/meshdeploy/network/meshdeploy.nft.new && mv -f "
                    "/etc/meshdeploy/network/meshdeploy.nft.new "
                    "/etc/meshdeploy/network/meshdeploy.nft")
    assert "ExecStart=/usr/sbin/nft -f /etc/meshdeploy/network/meshdeploy.nft\n" in unit
    assert "After=nftables.service" in unit and "Before=network-pre.target" in unit
    # For the next boot: nothing starts it now, so no reload of systemd.
    assert enable == "systemctl enable --no-reload --quiet meshdeploy-nftables"
    remove = rules.remove_commands()
    assert remove[-2] == "nft add table inet meshdeploy && nft delete table inet meshdeploy"
    # The boot unit is stopped (a RemainAfterExit oneshot stays "active") and forgotten.
    assert remove[0].startswith("systemctl disable --now --quiet meshdeploy-nftables")
    assert remove[-1] == "systemctl daemon-reload"
    assert not any("flush" in c for c in remove)


def test_the_boot_units_path_is_written_as_systemd_reads_it(monkeypatch):
    """The boot unit is rendered by core.units like the services' units: a path with a space,
    `%` or `$` reaches nft as written (systemd would split, resolve or expand it raw)."""
    from support.systemd_parse import exec_argv, settings

    path = "/etc/mesh deploy/50% $HOME.nft"
    monkeypatch.setattr(rules.d, "network_nft_file", path)
    (start,) = [v for k, v in settings(rules.boot_unit()) if k == "ExecStart"]
    assert exec_argv(start) == ["/usr/sbin/nft", "-f", path]


def test_comments_carry_no_nft_syntax():
    assert rules.comment_text('x" ; flush ruleset\n#') == "x? ? flush ruleset??"
    assert len(rules.comment_text("a" * 500)) <= 128


def render_golden(inventory: Path) -> str:
    cluster = load_inventory(inventory)
    out = [f"# {inventory.name}"]
    for host in cluster.hosts:
        mac = host.backend == "metal"
        out.append(f"## {host.name} ({'pf anchor' if mac else 'nftables'}) "
                   f"{json.dumps(rules.allowlist(cluster, host))}")
        out.append(pf.anchor_file(cluster, host) if mac else rules.nft_file(cluster, host))
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("inventory", INVENTORIES, ids=lambda p: p.stem)
def test_golden(inventory):
    golden.check(GOLDEN / f"{inventory.stem}.txt", render_golden(inventory))


def test_pf_anchor_blocks_only_and_keeps_sources_in_a_table(lab):
    text = pf.anchor_file(lab, lab.host("node2"))
    assert "table <meshdeploy_50052> const { 10.200.0.11 }" in text
    assert ("block drop in quick on ! lo0 proto tcp from ! <meshdeploy_50052> to any port 50052"
            in text)
    assert " pass " not in f" {text} " and "{ !" not in text
    no_loopback = pf.anchor([rules.Port(8080, ("10.0.0.1",), "llama-server x")], "h")
    assert "block drop in quick proto tcp from ! <meshdeploy_8080> to any port 8080" in no_loopback
    assert pf.pf_conf_lines() == ['anchor "meshdeploy"',
                                  'load anchor "meshdeploy" from "/etc/pf.anchors/meshdeploy"']
    write, load = pf.apply_commands(text)
    assert load.startswith("pfctl -n -a meshdeploy -f /etc/pf.anchors/meshdeploy.new && ")
    assert load.endswith("mv -f /etc/pf.anchors/meshdeploy.new /etc/pf.anchors/meshdeploy")


# -- the fact --------------------------------------------------------------------------------------

def test_fact_ignores_what_follows_a_drop_and_flags_an_open_accept():
    dport = {"payload": {"protocol": "tcp", "field": "dport"}}
    lo = {"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "lo"}}
    port = {"match": {"op": "==", "left": dport, "right": 50052}}
    rule = lambda *expr: {"rule": {"chain": "input", "expr": list(expr)}}  # noqa: E731
    chain = {"chain": {"name": "input", "type": "filter", "hook": "input", "policy": "accept"}}
    assert facts.read_table([chain, rule(port, lo, {"accept": None}),
                             rule(port, {"drop": None}), rule(port, lo, {"accept": None})]) == {
        "50052": ["lo"]}
    # Accepts without a drop filter nothing: the port is open, as if absent.
    assert facts.read_table([chain, rule(port, lo, {"accept": None})]) == {}
    flagged = facts.read_table([chain, rule(port, {"accept": None}), rule(port, {"drop": None})])
    assert flagged["50052"] == [] and len(flagged["other"]) == 1


# -- nft itself, in a throwaway network namespace ------------------------------------------

def _nft_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "nft in a private network namespace needs root"
    for tool, package in (("nft", "nftables"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool} is missing (Debian package {package})"
    return None


@pytest.fixture(scope="module")
def netns_nft():
    """Runs a shell script in a fresh network namespace (its own, empty ruleset)."""
    reason = _nft_unavailable()
    if reason:
        unmet(reason)

    def run(script: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["unshare", "-n", "sh", "-ec", script, "sh", *args],
                              capture_output=True, text=True, timeout=30)
    return run


def _host_cases():
    for inventory in INVENTORIES:
        cluster = load_inventory(inventory)
        for host in cluster.hosts:
            yield pytest.param(inventory, host.name, None, id=f"{inventory.stem}-{host.name}")
    yield pytest.param(LAB, "node1", "[10.0.0.0/24, 'fd00::/64', 192.168.7.9]",
                       id="lab-node1-allow-v4-v6")


@pytest.mark.system
@pytest.mark.parametrize("inventory, host_name, allow", list(_host_cases()))
def test_nft_accepts_the_file_and_the_fact_reads_back_the_wish(netns_nft, tmp_path, inventory,
                                                               host_name, allow):
    cluster = with_allow(tmp_path, allow) if allow else load_inventory(inventory)
    host = cluster.host(host_name)
    path = tmp_path / "meshdeploy.nft"
    path.write_text(rules.nft_file(cluster, host))
    # Check, load twice (the second replaces the first), then list as the fact does.
    proc = netns_nft('nft -c -f "$1"; nft -f "$1"; nft -f "$1"; '
                     'nft -j list table inet meshdeploy', str(path))
    assert proc.returncode == 0, proc.stderr
    live = facts.Allowlist().process(proc.stdout.splitlines())
    assert live == rules.allowlist(cluster, host)
    assert rules.diffs(rules.allowlist(cluster, host), live) == []


@pytest.mark.system
def test_loading_leaves_the_hosts_own_tables_alone(netns_nft, tmp_path, lab):
    path = tmp_path / "meshdeploy.nft"
    path.write_text(rules.nft_file(lab, lab.host("node2")))
    own = ("table inet user {\n\tchain c {\n\t\ttype filter hook input priority 0; "
           "policy accept;\n\t\ttcp dport 22 accept\n\t}\n}\n")
    (tmp_path / "own.nft").write_text(own)
    proc = netns_nft('nft -f "$1"; nft -f "$2"; nft -f "$2"; nft list table inet user; '
                     'echo @@; nft delete table inet meshdeploy; nft list ruleset',
                     str(tmp_path / "own.nft"), str(path))
    assert proc.returncode == 0, proc.stderr
    before, after = proc.stdout.split("@@\n")
    assert "tcp dport 22 accept" in before and "meshdeploy" not in after
    assert "table inet user" in after and "tcp dport 22 accept" in after


@pytest.mark.system
def test_nft_refuses_a_broken_file_and_keeps_the_loaded_table(netns_nft, tmp_path, lab):
    good, bad = tmp_path / "good.nft", tmp_path / "bad.nft"
    good.write_text(rules.nft_file(lab, lab.host("node2")))
    bad.write_text(rules.nft_file(lab, lab.host("node2")).replace("10.200.0.11", "10.200.0.999"))
    proc = netns_nft('nft -f "$1"; nft -f "$2" || echo refused; nft -j list table inet meshdeploy',
                     str(good), str(bad))
    assert proc.returncode == 0, proc.stderr
    head, _, listing = proc.stdout.partition("refused\n")
    assert listing, proc.stdout
    assert facts.Allowlist().process([listing]) == {"50052": ["lo", "10.200.0.11"]}
