"""Text and JSON are two views of one plan: every fact the text shows is in the JSON.

Plans are built as `meshdeploy plan` builds them, without hosts: the placement of a seed
scenario (tests/golden/test_placement_scenarios.py does the same for its goldens), the network section
from measured RTT facts, model bytes per host, warnings and a few changes. `disagreements` reads
the text back (placement tables, network lines, the model bytes table, warnings, per-host counts,
changes, summary) and compares it with the JSON; a test feeds it deliberately broken JSON to prove it can fail.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from support.device_facts import GB, GiB, cpu, cuda, mac
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.sources import HfFile, HfResolved
from meshdeploy.core.plan import AttrDiff, Change, Plan, TransferRow, load_plan, save_plan
from meshdeploy.errors import PlanError
from meshdeploy.placement import layout
from meshdeploy.roles.models import hf
from meshdeploy.roles.rpc_cache import seeding
from meshdeploy.roles.services.rtt import network as rtt_network
from meshdeploy.views.plan import render_json, render_text

ROOT = Path(__file__).resolve().parents[2]


LAB_HOST = cpu(25_183_293_440, 22_800_000_000)
M4MAX = mac(64 * GiB, 55_662_790_000, False, 58 * GB)
# Scenario -> (inventory, facts). "fitted": an 8 GiB mini, where llama.cpp's -fit shrinks the
# unset context; "unknown": the mini not probed (memory shown as "?").
SCENARIOS = {
    "lab": ("lab", {"node1": LAB_HOST, "node2": LAB_HOST, "node3": LAB_HOST}),
    "cuda-seeded": ("two-cuda-11-16", {"box11": cuda(11_500_000_000),
                                       "box16": cuda(16_800_000_000)}),
    "mac-fitted": ("two-macs-config-a", {"m4max": M4MAX,
                                         "macmini": mac(8 * GiB, 5_726_623_061, True, 6 * GB)}),
    "mac-unknown": ("two-macs-config-a", {"m4max": M4MAX}),
    "one-mac-local-workers": ("one-mac-mtl0-cpu", {"mac": M4MAX}),
    "android-rtt-zero": ("android-cpu-mesh", {
        "master": cpu(7_600_000_000, 3_400_000_000), "worker1": cpu(11_500_000_000, 6_100_000_000),
        "worker2": cpu(7_600_000_000, 3_900_000_000)}),
}


def built_plan(scenario: str) -> Plan:
    """The plan `meshdeploy plan` would print for a scenario, minus the probe."""
    inventory, facts = SCENARIOS[scenario]
    facts = copy.deepcopy(facts)
    cluster = load_cluster(ROOT / "inventories" / f"{inventory}.yaml")
    # Resolved on the endpoint the models role would ask (HfResolved.api), as hf.resolve records.
    resolved = run_values(models={
        name: HfResolved(m.source.repo, "c" * 40, (HfFile(m.source.files[0], 1, f"{i:064x}", "u"),),
                         api=hf.endpoints(cluster, m.source)[0])
        for i, (name, m) in enumerate(cluster.models.items())})
    seed_plan = seeding.prepare(cluster, cluster.hosts, facts, resolved)
    for server in cluster.servers:  # RTT as the orchestrator's probe reports it (microseconds)
        rtt = facts.setdefault(server.host, {}).setdefault("services.Rtt", {})
        for i, e in enumerate(cluster.rpc_endpoints(server)):
            us = 0 if scenario.endswith("zero") else 1234 * i + 87
            rtt[e.ssh_target] = us
    hosts = [h.name for h in cluster.hosts]
    changes = [Change(hosts[0], "llama_cpp", "build", "create",
                      [AttrDiff("ref", None, "b11312"), AttrDiff("commit", None,
                                                                 known_after_apply=True)]),
               Change(hosts[-1], "toolchain", "packages", "no-op"),
               Change(hosts[-1], "services", "rpc_server[50052]", "update",
                      [AttrDiff("port", 50051, 50052)], reason="port moved")]
    # The first host downloads the model, the others fetch their share over the LAN; the mini
    # that was not probed has no free disk space known.
    transfers = [TransferRow(h, 253_113_024, 0, 253_113_024, 40_100_000_000) if i == 0 else
                 TransferRow(h, 0, 102_400_000 * i, 102_400_000 * i,
                             9_870_000_000 if h in facts else None)
                 for i, h in enumerate(hosts)]
    return Plan(cluster_name=cluster.name, cluster_path=str(cluster.path), config_hash="c" * 64,
                fingerprints={h: f"{i:064x}" for i, h in enumerate(hosts)}, changes=changes,
                warnings=list(seed_plan.notes) + ["hosts run different llama.cpp builds\nsecond line of it"],
                hosts=hosts, created_at="2025-01-01T00:00:00Z", meshdeploy_version="0.1.0",
                commit="f" * 40, commit_source="lock file",
                placement=layout.sections(seed_plan.layouts),
                network=rtt_network(cluster, cluster.hosts, facts),
                transfers=transfers, remote_commands={h: 1 for h in hosts}, seconds=1.5,
                local_host=next((h.name for h in cluster.hosts if h.local), None))


# --- reading the text back ------------------------------------------------------------------

_PLACEMENT_HEAD = re.compile(
    r"Placement of (\S+) for llama-server (\S+) \((?:as llama\.cpp splits it|as tensor_split "
    r"sets it|split for speed by placement: auto); KV at (~?)(\d+) "
    r"tokens( as llama\.cpp fits ctx_size 0)?, (\d+) slots, ([^/]+)/(\S+)\):")
_NETWORK = re.compile(r"Network \((\S+) on (\S+)\): RTT (.*); expected per-token cost = "
                      r"compute \+ (\d+) x RTT \(~([\d.]+) ms\)")
_LAYERS = re.compile(r"(?:(\d+)(?:-(\d+))?|-)( \+ output)?")
_SUMMARY = re.compile(r"Plan: (\d+) to add, (\d+) to change, (\d+) to destroy\.")
_SIZE = re.compile(r"(\d+\.\d+) (GB|MB)")


def _table(lines: list[str], start: int) -> tuple[list[dict], int]:
    """A tabulate "simple" table at lines[start] (header, dashes, rows) as dicts; next index."""
    spans = [m.span() for m in re.finditer(r"-+", lines[start + 1])]
    spans = [(a, spans[i + 1][0] if i + 1 < len(spans) else None) for i, (a, _) in
             enumerate(spans)]
    head = [lines[start][a:b].strip() for a, b in spans]
    rows, i = [], start + 2
    while i < len(lines) and lines[i].strip():
        rows.append(dict(zip(head, (lines[i][a:b].strip() for a, b in spans))))
        i += 1
    return rows, i


def _near(text: str, value, scale: float, places: int) -> bool:
    """A printed figure (e.g. "0.04" GB) is the JSON's number (bytes) rounded for display."""
    if text in ("?", "-"):
        return value is None
    return value is not None and abs(float(text) - value / scale) <= 0.5 * 10**-places + 1e-9


def _size_near(text: str, value) -> bool:
    """A printed size ("253.1 MB", "12.30 GB"; "-" for 0, "?" for unknown) is `value` bytes."""
    if text in ("-", "?"):
        return value == {"-": 0, "?": None}[text]
    m = _SIZE.fullmatch(text)
    return bool(m) and _near(m[1], value, *{"GB": (1e9, 2), "MB": (1e6, 1)}[m[2]])


def _transfer_problems(rows: list[dict], doc: dict) -> list[str]:
    *hosts, total = rows or [{}]
    jt = doc.get("transfers") or []
    if [r["host"] for r in hosts] != [t["host"] for t in jt] or total.get("host") != "total":
        return ["model bytes per host: hosts differ"]
    out = []
    columns = [("from internet", "internet_bytes"), ("over LAN", "lan_bytes"),
               ("disk needed", "disk_bytes")]
    for t, j in zip(hosts, jt):
        for col, key in [*columns, ("disk free", "disk_free")]:
            if not _size_near(t[col], j[key]):
                out.append(f"model bytes of {t['host']}: {col} {t[col]!r} vs {j[key]!r}")
    for col, key in columns:
        if not _size_near(total[col], sum(j[key] for j in jt)):
            out.append(f"model bytes total: {col} {total[col]!r}")
    return out


def _row_problems(where: str, t: dict, j: dict) -> list[str]:
    out = []
    m = _LAYERS.fullmatch(t["layers"])
    first, last = (int(m[1]), int(m[2] or m[1])) if m and m[1] else (None, None)
    if not m or (first, last, bool(m[3])) != (j["first_layer"], j["last_layer"], j["output"]):
        out.append(f"{where}: layers {t['layers']!r}")
    free = t["free GB"]
    checks = [("weights GB", j["weights_bytes"], 1e9, 2), ("KV GB", j["kv_bytes"], 1e9, 2),
              ("seeded GB", j["seeded_bytes"], 1e9, 2), ("wire MB/load", j["wire_bytes"], 1e6, 1),
              ("free GB", j["free_bytes"], 1e9, 2), ("headroom GB", j["headroom_bytes"], 1e9, 2)]
    for col, value, scale, places in checks:
        if not _near(t[col].lstrip("~"), value, scale, places):
            out.append(f"{where}: {col} {t[col]!r} vs {value!r}")
    if free.startswith("~") != j["free_estimated"]:
        out.append(f"{where}: free GB {free!r} vs free_estimated {j['free_estimated']}")
    return out


def disagreements(text: str, doc: dict) -> list[str]:
    """Facts the text shows that the JSON lacks or states differently (empty: they agree)."""
    lines, out = text.splitlines(), []
    placements, networks, warnings, counts, actions = [], [], [], None, []
    transfers = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.split() == ["host", "add", "change", "destroy", "unchanged"]:
            counts, i = _table(lines, i)
            continue
        if line == "Model bytes per host:":
            transfers, i = _table(lines, i + 1)
            continue
        if m := _PLACEMENT_HEAD.fullmatch(line):
            rows, i = _table(lines, i + 1)
            placements.append((m, rows))
            continue
        if m := _NETWORK.fullmatch(line):
            networks.append(m)
        elif m := re.fullmatch(r"  # (\S+) (will be|must be) .*", line):
            actions.append(m[1])
        elif line.startswith("Warning: "):
            body = [line[len("Warning: "):]]
            while i + 1 < len(lines) and lines[i + 1].startswith("  "):
                i += 1
                body.append(lines[i][2:])
            warnings.append("\n".join(body))
        i += 1

    if [(r["host"], *map(int, (r["add"], r["change"], r["destroy"], r["unchanged"])))
            for r in counts or []] != \
            [(r["host"], r["add"], r["change"], r["destroy"], r["unchanged"])
             for r in doc.get("host_counts", [])]:
        out.append("host_counts differ")
    local = re.search(r"^(\S+) is this machine \(connection: local\)", text, re.M)
    if (local[1] if local else None) != doc.get("local_host"):
        out.append(f"local_host differs: {local and local[1]!r} vs {doc.get('local_host')!r}")
    if warnings != doc.get("warnings"):
        out.append(f"warnings differ: {warnings!r} vs {doc.get('warnings')!r}")
    if actions != [c["address"] for c in doc.get("changes", []) if c["action"] != "no-op"]:
        out.append("changed resources differ")
    summary = _SUMMARY.search(text)
    want = doc.get("counts", {})
    if summary and tuple(map(int, summary.groups())) != \
            (want.get("add"), want.get("change"), want.get("destroy")):
        out.append("summary counts differ")
    if (summary is None) == doc.get("has_changes", False):
        out.append("has_changes differs from the summary line")

    if transfers is not None or doc.get("transfers"):
        out += _transfer_problems(transfers or [], doc)

    jp = doc.get("placement") or []
    if len(placements) != len(jp):
        out.append(f"{len(placements)} placement tables in text, {len(jp)} in JSON")
    for (m, rows), p in zip(placements, jp):
        where = f"placement {p['server']}"
        head = (m[1], m[2], int(m[4]), bool(m[3]), int(m[6]), m[7], m[8])
        if head != (p["model"], p["server"], p["ctx_tokens"], p["ctx_fitted_from"] is not None,
                    p["slots"], p["cache_type_k"], p["cache_type_v"]):
            out.append(f"{where}: heading {m[0]!r}")
        if [r["device"] for r in rows] != [r["device"] for r in p["rows"]]:
            out.append(f"{where}: devices differ")
        for t, j in zip(rows, p["rows"]):
            out += _row_problems(f"{where} {t['device']}", t, j)

    jn = doc.get("network") or []
    if len(networks) != len(jn):
        out.append(f"{len(networks)} network lines in text, {len(jn)} in JSON")
    for m, n in zip(networks, jn):
        shown = [p.rsplit(" ", 2)[:2] for p in m[3].split(", ")]
        if (m[1], m[2], int(m[4])) != (n["server"], n["host"], n["round_trips"]) or \
                not _near(m[5], n["per_token_ms"], 1, 2) or \
                [e for e, _ in shown] != [e["endpoint"] for e in n["endpoints"]] or \
                not all(_near(ms, e["rtt_ms"], 1, 2) for (_, ms), e in zip(shown, n["endpoints"])):
            out.append(f"network {n['server']}: {m[0]!r}")
    return out


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_text_and_json_agree(scenario, headers):
    plan = built_plan(scenario)
    text, doc = render_text(plan), json.loads(render_json(plan))
    # the check has something to compare
    assert "Placement of " in text and "Network (" in text and "Model bytes per host:" in text
    assert disagreements(text, doc) == []


def test_json_carries_the_sections_as_numbers(headers):
    doc = json.loads(render_json(built_plan("cuda-seeded")))
    assert doc["format_version"] == 2
    (p,) = doc["placement"]
    assert (p["server"], p["model"], p["ctx_tokens"], p["slots"]) == ("main", "gemma27", 32768, 4)
    rpc, local = p["rows"]
    assert (rpc["device"], rpc["host"], rpc["port"]) == ("box11:50052/CUDA0", "box11", 50052)
    assert (rpc["first_layer"], rpc["last_layer"], rpc["output"]) == (0, 25, False)
    assert rpc["seeded_bytes"] > 6 * GB and local["seeded_bytes"] is None
    assert local["wire_bytes"] == 0 and local["output"] is True
    (n,) = doc["network"]
    assert (n["server"], n["host"], n["round_trips"]) == ("main", "box16", 1)
    assert n["endpoints"] == [{"endpoint": "10.0.0.5:50052", "host": "box11", "rtt_ms": 0.087,
                               "remote": True}]
    assert doc["commit"] == "f" * 40 and doc["commit_source"] == "lock file"
    assert doc["remote_commands"] == {"box11": 1, "box16": 1} and doc["seconds"] == 1.5
    assert doc["warnings"][-1] == "hosts run different llama.cpp builds\nsecond line of it"


def _broken(doc: dict, how: str) -> dict:
    doc = copy.deepcopy(doc)
    if how == "placement dropped":
        doc.pop("placement")
    elif how == "row figure changed":
        doc["placement"][0]["rows"][0]["kv_bytes"] += 50_000_000
    elif how == "estimate flag lost":
        row = doc["placement"][0]["rows"][0]
        row["free_estimated"] = not row["free_estimated"]
    elif how == "layers moved":
        doc["placement"][0]["rows"][0]["last_layer"] += 1
    elif how == "network dropped":
        doc["network"] = []
    elif how == "rtt changed":
        doc["network"][0]["endpoints"][0]["rtt_ms"] += 0.5
    elif how == "warning dropped":
        doc["warnings"] = doc["warnings"][:-1]
    elif how == "host count changed":
        doc["host_counts"][0]["unchanged"] += 1
    elif how == "local host dropped":
        doc["local_host"] = None
    elif how == "transfers dropped":
        doc.pop("transfers")
    elif how == "transfer figure changed":
        doc["transfers"][1]["lan_bytes"] += 1_000_000
    elif how == "free disk lost":
        doc["transfers"][0]["disk_free"] = None
    return doc


@pytest.mark.parametrize("how", ["placement dropped", "row figure changed", "estimate flag lost",
                                 "layers moved", "network dropped", "rtt changed",
                                 "warning dropped", "host count changed",
                                 "local host dropped", "transfers dropped",
                                 "transfer figure changed", "free disk lost"])
def test_the_agreement_check_catches_a_broken_json(how, headers):
    plan = built_plan("one-mac-local-workers" if how == "local host dropped" else "mac-fitted")
    text, doc = render_text(plan), json.loads(render_json(plan))
    assert disagreements(text, doc) == []
    assert disagreements(text, _broken(doc, how)) != []


@pytest.mark.parametrize("scenario", ["cuda-seeded", "mac-unknown", "one-mac-local-workers"])
def test_saved_plan_round_trips_its_typed_sections(scenario, headers, tmp_path):
    plan = built_plan(scenario)
    plan.limit = ["box16"] if scenario == "cuda-seeded" else []
    save_plan(plan, tmp_path / "p.plan")
    again = load_plan(tmp_path / "p.plan")
    assert again == plan
    assert again.placement and again.network and again.transfers  # the equality covered them
    assert render_text(again) == render_text(plan)
    assert render_json(again) == render_json(plan)


def test_a_saved_plan_with_a_malformed_section_is_one_clear_error(headers, tmp_path):
    d = built_plan("lab").to_dict()
    d["placement"][0]["rows"][1]["kv_bytes"] = "0.02"
    f = tmp_path / "p.plan"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"plan\.placement\[0\]\.rows\[1\]\.kv_bytes: expected an "
                                        r"integer"):
        load_plan(f)
    d["placement"][0]["rows"][1]["kv_bytes"] = 1
    d["network"][0]["endpoints"][0]["colour"] = "red"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"plan\.network\[0\]\.endpoints\[0\]: unknown key "
                                        r"'colour'"):
        load_plan(f)


def test_a_format_1_plan_is_refused_with_a_replan_hint(tmp_path):
    f = tmp_path / "old.plan"
    f.write_text(json.dumps({"format_version": 1, "extra": {"placement": "..."}}))
    with pytest.raises(PlanError) as e:
        load_plan(f)
    assert "plan format 1 is not supported (this meshdeploy reads format 2)" in str(e.value)
    assert "meshdeploy plan" in e.value.hint


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_show_prints_a_saved_plan_as_plan_did(as_json, headers, tmp_path):
    from support.cli import meshdeploy

    plan = built_plan("cuda-seeded")
    save_plan(plan, tmp_path / "p.plan")
    out = meshdeploy("show", tmp_path / "p.plan", *(["--json"] if as_json else []))
    assert out.returncode == 0, out.stderr
    assert out.stdout == (render_json(plan) if as_json else render_text(plan)) + "\n"


def test_show_of_a_file_that_is_no_plan_is_one_clear_error(tmp_path):
    from support.cli import meshdeploy

    bad = tmp_path / "cluster.yaml"
    bad.write_text("cluster: c\n")
    out = meshdeploy("show", bad)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") <= 3 and str(bad) in out.stderr


def test_what_hosts_said_reaches_the_terminal_inert():
    """A plan carries host text: `current` is the name of the build the host's link points at
    (a rootless host's login user names it), a unit diff holds the host's file. Its text view
    shows their control characters as escapes and keeps only its own colours."""
    plan = built_plan("lab")
    link = "b1\x1b]52;c;aGk=\x07"
    plan.changes.append(Change("node1", "llama_cpp", "build", "update",
                               [AttrDiff("current", link, "0123456789ab-cpu-x"),
                                AttrDiff("flags", {"k\x1b[2J": "v\x9b"}, None)],
                               reason="current moves\x9b31m",
                               unit_diff="-ExecStart=/x\x1b[2J\n+ExecStart=/y"))
    for color in (False, True):
        text = render_text(plan, color=color)
        assert "\x07" not in text and "\x9b" not in text and "\x1b]" not in text
        assert "\x1b[2J" not in text
        assert '"b1\\u001b]52;c;aGk=\\u0007"' in text and "moves\\x9b31m" in text
        assert '{ k\\x1b[2J = "v\\x9b" }' in text and "-ExecStart=/x\\x1b[2J" in text
    assert "\x1b[" in render_text(plan, color=True)  # its own colours stay
    assert json.loads(render_json(plan))  # the JSON escapes them itself
