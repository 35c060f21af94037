"""Model bytes per host: the engine sums each host's step Transfers into Plan.transfers, the text
view prints them as a table, the JSON and saved plans carry them (docs/plan-json.md)."""

from __future__ import annotations

import json
import re

import pytest

from meshdeploy.core.context import Step, Steps, Transfer
from meshdeploy.core.plan import (
    FORMAT_VERSION,
    Change,
    Network,
    Placement,
    Plan,
    RttEndpoint,
    TransferRow,
    load_plan,
    save_plan,
)
from meshdeploy.engine.planner import transfer_rows
from meshdeploy.errors import PlanError
from meshdeploy.views.plan import render_json, render_text

MB, GB = 1_000_000, 1_000_000_000


def _step(host: str, resource: str, transfer: Transfer | None = None) -> Step:
    role, _, name = resource.partition(".")
    return Step(Change(host, role, name, "create" if transfer else "no-op"), transfer=transfer)


def _steps(*added: tuple[str, str, Transfer | None]) -> Steps:
    steps = Steps()
    for host, resource, transfer in added:
        steps.add(host, resource, _step(host, resource, transfer))
    return steps


def _plan(transfers: list[TransferRow], **kw) -> Plan:
    hosts = ["node1", "node2", "node3"]
    return Plan(cluster_name="lab", cluster_path="inventories/lab.yaml", config_hash="c" * 64,
                fingerprints={h: f"{i:064x}" for i, h in enumerate(hosts)},
                changes=[Change("node1", "models", "gguf[gemma]", "create")], hosts=hosts,
                created_at="2025-01-01T00:00:00Z", meshdeploy_version="0.1.0",
                transfers=transfers, **kw)


TWO_HOSTS = [TransferRow("node1", 253_113_024, 0, 253_113_024, 12_300_000_000),
             TransferRow("node3", 0, 204_800_000, 204_800_000, None)]


# --- summing a host's steps ----------------------------------------------------------------


def test_each_host_sums_its_steps_and_keeps_the_least_free_disk():
    steps = _steps(
        ("node1", "toolchain.packages", None),
        ("node1", "models.gguf[gemma]", Transfer(internet_bytes=253 * MB, disk_bytes=253 * MB,
                                                 disk_free=40 * GB)),
        ("node1", "models.gguf[qwen]", Transfer(internet_bytes=1 * GB, disk_bytes=1 * GB,
                                                disk_free=12 * GB)),
        ("node1", "rpc_cache.seed[50052]", Transfer(lan_bytes=5 * MB, disk_bytes=5 * MB)),
        ("node2", "toolchain.packages", None),  # nothing to fetch: no row
        ("node2", "models.gguf[gemma]", None),
        ("node3", "rpc_cache.seed[50052]", Transfer(lan_bytes=100 * MB, disk_bytes=100 * MB)),
        ("node3", "rpc_cache.seed[50053]", Transfer(lan_bytes=2 * MB, disk_bytes=2 * MB)),
    )
    assert transfer_rows(["node1", "node2", "node3"], steps) == [
        TransferRow("node1", 1253 * MB, 5 * MB, 1258 * MB, 12 * GB),  # the least free disk
        TransferRow("node3", 0, 102 * MB, 102 * MB, None),  # no free disk known
    ]


def test_rows_follow_the_hosts_order_not_the_steps_order():
    steps = _steps(("node3", "models.gguf[gemma]", Transfer(internet_bytes=1, disk_bytes=1)),
                   ("node1", "rpc_cache.seed[50052]", Transfer(lan_bytes=1, disk_bytes=1)))
    assert [r.host for r in transfer_rows(["node1", "node2", "node3"], steps)] == \
        ["node1", "node3"]
    # A host outside the plan's hosts (a --limit run) gets no row.
    assert [r.host for r in transfer_rows(["node3"], steps)] == ["node3"]


def test_a_transfer_of_no_bytes_makes_no_row():
    steps = _steps(("node1", "models.gguf[gemma]", Transfer(disk_free=12 * GB)),
                   ("node2", "models.gguf[gemma]", Transfer(disk_bytes=1)))
    assert transfer_rows(["node1", "node2"], steps) == [TransferRow("node2", 0, 0, 1, None)]
    assert transfer_rows(["node1", "node2"], Steps()) == []


# --- the text view -------------------------------------------------------------------------


def _section(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("Model bytes per host:")
    end = lines.index("", start)
    return lines[start:end]


def test_text_shows_a_table_with_dashes_for_none_and_a_total():
    text = render_text(_plan(TWO_HOSTS))
    head, columns, rule, *rows = _section(text)
    assert columns.split() == ["host", "from", "internet", "over", "LAN", "disk", "needed",
                               "disk", "free"]
    assert set(rule) <= {"-", " "}
    assert [re.split(r"\s{2,}", row) for row in rows] == [
        ["node1", "253.1 MB", "-", "253.1 MB", "12.30 GB"],
        ["node3", "-", "204.8 MB", "204.8 MB", "?"],  # free disk unknown
        ["total", "253.1 MB", "204.8 MB", "457.9 MB"],
    ]
    assert all(line == line.rstrip() for line in rows)


def test_text_puts_the_table_after_placement_and_network_and_before_the_warnings():
    placement = Placement("main", "gemma", 2048, None, 1, "f16", "f16")
    network = Network("main", "node1", [RttEndpoint("10.200.0.12:50052", "node2", 0.15, True)],
                      1, 0.15)
    lines = render_text(_plan(TWO_HOSTS, warnings=["careful"], placement=[placement],
                              network=[network])).splitlines()
    order = [next(i for i, line in enumerate(lines) if line.startswith(start))
             for start in ("host ", "Placement of gemma", "Network (main on node1)",
                           "Model bytes per host:", "Warning: careful", "Plan: ")]
    assert order == sorted(order) and order[-1] == len(lines) - 1


def test_no_transfers_no_section():
    text = render_text(_plan([]))
    assert "Model bytes" not in text and "from internet" not in text


# --- JSON and saved plans ------------------------------------------------------------------


def test_json_carries_the_rows_as_bytes():
    doc = json.loads(render_json(_plan(TWO_HOSTS)))
    assert doc["format_version"] == FORMAT_VERSION == 2
    assert doc["transfers"] == [
        {"host": "node1", "internet_bytes": 253_113_024, "lan_bytes": 0,
         "disk_bytes": 253_113_024, "disk_free": 12_300_000_000},
        {"host": "node3", "internet_bytes": 0, "lan_bytes": 204_800_000,
         "disk_bytes": 204_800_000, "disk_free": None},
    ]
    assert json.loads(render_json(_plan([])))["transfers"] == []


def test_to_dict_from_dict_and_saved_plans_keep_transfers(tmp_path):
    plan = _plan(TWO_HOSTS)
    d = plan.to_dict()
    assert d["transfers"][1] == {"host": "node3", "internet_bytes": 0, "lan_bytes": 204_800_000,
                                 "disk_bytes": 204_800_000, "disk_free": None}
    again = Plan.from_dict(json.loads(json.dumps(d)))
    assert again == plan and again.transfers == TWO_HOSTS
    assert all(isinstance(t, TransferRow) for t in again.transfers)
    save_plan(plan, tmp_path / "p.plan")
    assert load_plan(tmp_path / "p.plan") == plan
    # A plan that fetches nothing leaves the list empty, and reads back the same.
    d.pop("transfers")
    assert Plan.from_dict(d).transfers == []


@pytest.mark.parametrize("row, message", [
    ({"host": "node1", "internet_bytes": "253 MB", "lan_bytes": 0, "disk_bytes": 0,
      "disk_free": None}, r"plan\.transfers\[0\]\.internet_bytes: expected an integer"),
    ({"host": "node1", "internet_bytes": 1, "lan_bytes": 0, "disk_bytes": 1},
     r"plan\.transfers\[0\]: missing key 'disk_free'"),
    ({"host": "node1", "internet_bytes": 1, "lan_bytes": 0, "disk_bytes": 1, "disk_free": None,
      "speed": 3}, r"plan\.transfers\[0\]: unknown key 'speed'"),
])
def test_a_malformed_transfer_row_is_one_clear_error(tmp_path, row, message):
    d = _plan(TWO_HOSTS).to_dict()
    d["transfers"][0] = row
    f = tmp_path / "p.plan"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=message):
        load_plan(f)


def test_a_saved_plan_without_transfers_loads_with_none(tmp_path):
    d = _plan([TransferRow("node1", 5, 0, 5, None)]).to_dict()
    d.pop("transfers")
    f = tmp_path / "old.plan"
    f.write_text(json.dumps(d))
    assert load_plan(f).transfers == []
