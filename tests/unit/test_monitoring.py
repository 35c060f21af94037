"""Watching a cluster with Prometheus: `monitoring.scrapers` in the allow-list, the files
`meshdeploy prometheus` writes (checked by promtool, the recording rules run by `promtool test
rules` on series shaped like the lab's), and the golden of the lab's files.

The lab test (tests/lab/test_prometheus_lab.py) runs Debian's prometheus and blackbox exporter
against the converged lab."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML
from support import golden
from support.cli import meshdeploy
from support.require import require, unmet

from meshdeploy.core.loading import load_cluster
from meshdeploy.errors import ConfigError
from meshdeploy.roles.monitoring import prometheus
from meshdeploy.roles.network import rules

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
LAB = ROOT / "inventories" / "lab.yaml"
GOLDEN = TESTS / "golden" / "monitoring"

# The lab as the Prometheus lab test runs it: llama-server on node1's address with an API key,
# Prometheus on the lab's bridge address.
WATCHED = {"    bind: 127.0.0.1\n":
           "    bind: 10.200.0.11\n    api_key_file: /etc/meshdeploy/main.key\n",
           "hosts:\n": "monitoring:\n  scrapers: [10.200.0.1]\nhosts:\n"}


def cluster_file(tmp_path: Path, edits: dict, source: Path = LAB) -> Path:
    text = source.read_text()
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


def watched(tmp_path):
    return load_cluster(cluster_file(tmp_path, WATCHED))


# -- the allow-list ------------------------------------------------------------------------------

def test_scrapers_reach_every_service_port_a_scraper_can_reach(tmp_path):
    cluster = watched(tmp_path)
    assert rules.allowlist(cluster, cluster.host("node1")) == {"8080": ["lo", "10.200.0.1"]}
    for worker in ("node2", "node3"):
        assert rules.allowlist(cluster, cluster.host(worker)) == \
            {"50052": ["lo", "10.200.0.1", "10.200.0.11"]}
    table = rules.nft_file(cluster, cluster.host("node2"))
    assert "tcp dport 50052 ip saddr { 10.200.0.1, 10.200.0.11 } accept" in table


def test_without_scrapers_nothing_changes_and_a_loopback_server_is_not_opened(tmp_path):
    lab = load_cluster(LAB)
    assert rules.allowlist(lab, lab.host("node1")) == {"8080": ["lo"]}
    assert rules.allowlist(lab, lab.host("node2")) == {"50052": ["lo", "10.200.0.11"]}
    only_scrapers = load_cluster(cluster_file(tmp_path, {"hosts:\n": WATCHED["hosts:\n"]}))
    # llama-server binds 127.0.0.1: no scraper reaches it, so its port stays loopback only.
    assert rules.allowlist(only_scrapers, only_scrapers.host("node1")) == {"8080": ["lo"]}


def test_under_wireguard_the_rpc_ports_stay_inside_the_tunnel(tmp_path):
    source = ROOT / "inventories" / "lab-wireguard.yaml"
    cluster = load_cluster(cluster_file(tmp_path, {"hosts:\n": WATCHED["hosts:\n"]}, source))
    for host in cluster.hosts:
        for port, sources in rules.allowlist(cluster, host).items():
            if port == "50052":
                assert "10.200.0.1" not in sources, (host.name, sources)
    assert any("WireGuard tunnel" in note for note in prometheus.skipped(cluster))


def test_a_scraper_that_is_no_address_is_one_error_at_its_position(tmp_path):
    path = cluster_file(tmp_path, {"hosts:\n": "monitoring:\n  scrapers: "
                                   "[10.0.0.1, prometheus.example]\nhosts:\n"})
    done = meshdeploy("validate", path)
    assert done.returncode == 3 and "Traceback" not in done.stderr  # 3: a configuration error
    line = Path(path).read_text().splitlines().index(
        "  scrapers: [10.0.0.1, prometheus.example]") + 1  # the line the edit added
    assert (f"{path}:{line}:24: monitoring.scrapers[1]: 'prometheus.example' is not an IP "
            "address or network") in done.stderr, done.stderr


def test_the_units_let_the_scrapers_in_where_they_filter(tmp_path):
    """systemd's IPAddressAllow= would drop what the nftables table accepts."""
    from meshdeploy.roles.services import unit_files

    edits = {**WATCHED, "    ctx_size: 2048\n": "    ctx_size: 2048\n    allow: [10.9.9.0/24]\n"}
    cluster = load_cluster(cluster_file(tmp_path, edits))
    node2 = cluster.host("node2")
    rpc = unit_files.rpc_unit(cluster, node2, node2.rpc_servers[0], "/b", "rpc-server")
    assert "IPAddressAllow=localhost 10.200.0.11 10.200.0.12 10.200.0.1\n" in rpc
    server = unit_files._server_firewall(cluster, cluster.servers[0], "servers.main")
    assert server.endswith(" 10.9.9.0/24 10.200.0.1\n"), server


def test_an_unknown_key_of_monitoring_is_an_error_at_its_line(tmp_path):
    path = cluster_file(tmp_path, {"hosts:\n": "monitoring:\n  scraper: [10.0.0.1]\nhosts:\n"})
    with pytest.raises(ConfigError) as caught:
        load_cluster(path)
    text = str(caught.value) + " ".join(str(i) for i in getattr(caught.value, "issues", []))
    line = Path(path).read_text().splitlines().index("  scraper: [10.0.0.1]") + 1
    assert "scraper" in text and f":{line}:" in text, text


# -- the files -----------------------------------------------------------------------------------

def test_the_lab_files_are_the_golden_ones(tmp_path):
    docs = prometheus.documents(watched(tmp_path), interval=5)
    golden.check(GOLDEN / "lab.txt", "".join(f"==> {name} <==\n{text}\n"
                                             for name, text in docs.items()))


def test_values_from_the_cluster_file_stay_strings(tmp_path):
    """Names YAML would read as a null, a boolean and a number, as labels and job names."""
    path = cluster_file(tmp_path, {**WATCHED, "cluster: lab\n": "cluster: 'null'\n",
                                   "servers:\n  main:\n": "servers:\n  '1e3':\n"})
    cluster = load_cluster(path)
    config = YAML(typ="safe").load(prometheus.documents(cluster)["prometheus.yml"])
    (server,) = [j for j in config["scrape_configs"]
                 if j["static_configs"][0]["labels"]["job"] == "meshdeploy-llama-server"]
    assert server["static_configs"][0]["labels"] == {"job": "meshdeploy-llama-server",
                                                     "cluster": "null", "host": "node1",
                                                     "server": "1e3"}
    assert server["authorization"]["credentials_file"] == "keys/1e3"


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    require("promtool")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)


def write_files(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    done = meshdeploy("prometheus", cluster_file(tmp_path, WATCHED), "--out", out, "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["key_files"] == [{"server": "main", "host": "node1",
                                    "source": "/etc/meshdeploy/main.key",
                                    "path": str(out / "keys" / "main")}]
    return out


def test_promtool_accepts_the_files_once_the_key_is_in_place(tmp_path):
    out = write_files(tmp_path)
    missing = promtool("check", "config", "prometheus.yml", cwd=out)
    assert missing.returncode != 0 and "keys/main" in missing.stdout + missing.stderr
    (out / "keys").mkdir()
    (out / "keys" / "main").write_text("the-key\n")
    checked = promtool("check", "config", "prometheus.yml", cwd=out)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 5 rules found" in checked.stdout


# Series as the lab gives them, one sample per 15 s. node2's rpc-server: connected (no client
# yet), then a timed-out connect (llama-server holds the connection, the accept queue is full),
# then refused (stopped), then a timeout again but with its host gone. node3's stays connected.
# llama-server main: one completion of 64 tokens in 8 s of generating ends between 15 s and 30 s.
RULE_TESTS = """
rule_files: [meshdeploy.rules.yml]
evaluation_interval: 15s
tests:
  - interval: 15s
    input_series:
      - series: 'probe_success{job="meshdeploy-rpc-server",cluster="lab",host="node2",port="50052",instance="10.200.0.12:50052"}'
        values: '1 0 0 0'
      - series: 'probe_duration_seconds{job="meshdeploy-rpc-server",cluster="lab",host="node2",port="50052",instance="10.200.0.12:50052"}'
        values: '0.002 2.0 0.001 2.0'
      - series: 'probe_success{job="meshdeploy-host",cluster="lab",host="node2",instance="10.200.0.12:22"}'
        values: '1 1 1 0'
      - series: 'probe_success{job="meshdeploy-rpc-server",cluster="lab",host="node3",port="50052",instance="10.200.0.13:50052"}'
        values: '1 1 1 1'
      - series: 'probe_duration_seconds{job="meshdeploy-rpc-server",cluster="lab",host="node3",port="50052",instance="10.200.0.13:50052"}'
        values: '0.002 0.002 0.002 0.002'
      - series: 'probe_success{job="meshdeploy-host",cluster="lab",host="node3",instance="10.200.0.13:22"}'
        values: '1 1 1 1'
      - series: 'llamacpp:tokens_predicted_total{job="meshdeploy-llama-server",cluster="lab",host="node1",server="main",instance="10.200.0.11:8080"}'
        values: '100 100 164 164'
      - series: 'llamacpp:tokens_predicted_seconds_total{job="meshdeploy-llama-server",cluster="lab",host="node1",server="main",instance="10.200.0.11:8080"}'
        values: '10 10 18 18'
    promql_expr_test:
%s
"""


def _expect(expr: str, at: str, value: float | None, labels: str) -> str:
    samples = ("[]" if value is None else
               f"\n          - labels: '{labels}'\n            value: {value}")
    return f"      - expr: {expr}\n        eval_time: {at}\n        exp_samples: {samples}\n"


def test_the_recording_rules_on_the_lab_s_series(tmp_path):
    out = write_files(tmp_path)
    node2 = 'meshdeploy:rpc_server_up{cluster="lab",host="node2",port="50052"}'
    workers = 'meshdeploy:workers_up{cluster="lab"}'
    speed = 'meshdeploy:generation_tokens_per_second:5m{cluster="lab",host="node1",server="main"}'
    cases = [("meshdeploy:rpc_server_up{host=\"node2\"}", "0s", 1, node2),
             ("meshdeploy:rpc_server_up{host=\"node2\"}", "15s", 1, node2),  # in use: timed out
             ("meshdeploy:rpc_server_up{host=\"node2\"}", "30s", 0, node2),  # refused: stopped
             ("meshdeploy:rpc_server_up{host=\"node2\"}", "45s", 0, node2),  # its host is gone
             ("meshdeploy:workers_up", "15s", 2, workers),
             ("meshdeploy:workers_up", "30s", 1, workers),
             # The completion's own rate: 64 tokens in 8 s; nothing before it ended.
             ("meshdeploy:generation_tokens_per_second:5m", "15s", None, ""),
             ("meshdeploy:generation_tokens_per_second:5m", "45s", 8, speed)]
    (out / "rules.test.yml").write_text(RULE_TESTS % "".join(_expect(*c) for c in cases))
    done = promtool("test", "rules", "rules.test.yml", cwd=out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_blackbox_exporter_accepts_its_module(tmp_path):
    require("prometheus-blackbox-exporter")
    out = write_files(tmp_path)
    done = subprocess.run(["prometheus-blackbox-exporter", "--config.check",
                           f"--config.file={out / 'blackbox.yml'}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Config file is ok" in done.stderr, done.stderr


def test_the_summary_names_what_prometheus_cannot_reach(tmp_path):
    done = meshdeploy("prometheus", LAB, "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert "Not scraped: llama-server main on node1 binds 127.0.0.1" in done.stdout
    assert "monitoring.scrapers is empty" in done.stdout
    assert (tmp_path / "out" / "prometheus.yml").exists()


def test_a_folder_that_cannot_be_written_is_one_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = meshdeploy("prometheus", LAB, "--out", blocker / "out")
    assert done.returncode == 1 and "cannot write the Prometheus files" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_interval_too_short_for_the_probe_timeout_is_a_usage_error(tmp_path):
    done = meshdeploy("prometheus", LAB, "--out", tmp_path / "out", "--interval", "2")
    assert done.returncode == 1 and "expected whole seconds from 3 to 3600, got '2'" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.system
def test_prometheus_and_its_blackbox_exporter_in_a_namespace(tmp_path):
    """The files at work, in seconds and without the lab: Debian's prometheus and blackbox
    exporter in a fresh network namespace, against listeners shaped as the lab's services
    (tests/support/prometheus_netns.py). node2's rpc-server is in use (listen(1), as ggml-rpc,
    one connection held): its probes time out after two, and it counts up; node3's stops
    (refused): down. The completion's 64 tokens in 8 s read 8 tok/s."""
    if os.geteuid() != 0:
        unmet("a network namespace of its own needs root")
    require("prometheus", "prometheus-blackbox-exporter", "unshare", "ip")
    text = cluster_file(tmp_path, WATCHED).read_text().replace("10.200.0.", "10.77.0.")
    (tmp_path / "cluster.yaml").write_text(text)
    out = tmp_path / "out"
    blackbox = "127.0.0.1:19115"
    done = meshdeploy("prometheus", tmp_path / "cluster.yaml", "--out", out, "--interval", "3",
                      "--blackbox", blackbox)
    assert done.returncode == 0, done.stderr
    (out / "keys").mkdir()
    (out / "keys" / "main").write_text("k")
    ran = subprocess.run(["unshare", "-n", sys.executable, str(TESTS / "support" /
                                                                "prometheus_netns.py"),
                          str(out), blackbox], capture_output=True, text=True, timeout=300)
    seen = {r["name"]: r for r in map(json.loads, ran.stdout.splitlines())}
    assert ran.returncode == 0 and not [r for r in seen.values() if r.get("timeout")], \
        ran.stdout + ran.stderr
    assert seen["busy duration"]["value"]["node2"] >= 1.9  # the whole 2 s: a dropped SYN
    assert seen["up while busy"]["value"] == {"node2": 1.0, "node3": 1.0}
    assert seen["speed"]["value"] == {"node1": 8.0}
    assert seen["node3 down"]["value"] == {"node2": 1.0, "node3": 0.0}
    assert seen["workers up"]["value"] == {"": 1.0}


def test_scrapers_reach_rpc_servers_only_as_single_addresses_and_stay_private(tmp_path):
    """A scraper's probe could use a worker as an orchestrator does: an rpc-server port opens
    to single scraper addresses alone (its allow-list and its unit's IPAddressAllow=); beyond
    the private ranges a scraper is refused unless network.allow_public."""
    from meshdeploy.core.loading import load_cluster
    from meshdeploy.errors import ConfigError
    from meshdeploy.roles.network import rules
    from meshdeploy.roles.services import unit_files

    base = (ROOT / "inventories" / "lab.yaml").read_text()
    path = tmp_path / "c.yaml"
    path.write_text(base + "monitoring:\n  scrapers: [10.200.0.1, 10.200.0.0/24]\n")
    cluster = load_cluster(path)
    node2 = rules.allowlist(cluster, cluster.host("node2"))
    assert "10.200.0.1" in node2["50052"] and "10.200.0.0/24" not in node2["50052"], node2
    node2_host = cluster.host("node2")
    unit = unit_files.rpc_unit(cluster, node2_host, node2_host.rpc_servers[0], "/opt/b",
                               "ggml-rpc-server")
    allowed = next(line for line in unit.splitlines() if line.startswith("IPAddressAllow="))
    assert "10.200.0.1" in allowed and "10.200.0.0/24" not in allowed, allowed
    path.write_text(base + "monitoring:\n  scrapers: [203.0.113.7]\n")
    with pytest.raises(ConfigError, match="not inside a private network"):
        load_cluster(path)
    path.write_text(base.replace("allow_public: false", "allow_public: true")
                    + "monitoring:\n  scrapers: [203.0.113.7]\n")
    assert prometheus.scrapers(load_cluster(path)) == ["203.0.113.7"]
