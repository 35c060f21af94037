"""The plan model, its text/JSON renderings, and saved plan files."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from meshdeploy.core import files as files_mod
from meshdeploy.core.plan import (
    AttrDiff,
    Change,
    Plan,
    TransferRow,
    check_fresh,
    fingerprint,
    hash_files,
    load_plan,
    save_plan,
)
from meshdeploy.errors import PlanError, StalePlanError
from meshdeploy.views.plan import (
    render_apply_summary,
    render_json,
    render_text,
    strip_ansi,
)

GOLDEN = Path(__file__).parents[1] / "golden" / "plan"
UPDATE = os.environ.get("MESHDEPLOY_UPDATE_GOLDEN") == "1"

UNIT_DIFF = """\
--- a/etc/systemd/system/meshdeploy-llama-server.service
+++ b/etc/systemd/system/meshdeploy-llama-server.service
@@ -6,7 +6,7 @@
 [Service]
 DynamicUser=yes
-ExecStart=/opt/meshdeploy/llama.cpp/b7000/bin/llama-server -m /var/lib/meshdeploy/models/gemma-3-270m-q4_k_m.gguf --rpc 10.200.0.12:50052 -ngl 99 -c 2048
+ExecStart=/opt/meshdeploy/llama.cpp/b11312/bin/llama-server -m /var/lib/meshdeploy/models/gemma-3-270m-q4_k_m.gguf --rpc 10.200.0.12:50052,10.200.0.13:50052 -ngl 99 -c 2048
 Restart=on-failure
"""


def _plan(changes, **kw) -> Plan:
    hosts = kw.pop("hosts", None) or list(dict.fromkeys(c.host for c in changes))
    return Plan(
        cluster_name="lab",
        cluster_path="inventories/lab.yaml",
        config_hash="c" * 64,
        fingerprints={h: f"{i:064x}" for i, h in enumerate(hosts)},
        changes=changes,
        hosts=hosts,
        **kw,
    )


def realistic_plan() -> Plan:
    """Upgrade the pin b7000 -> b11312 on a 3-host lab and move one worker's port."""
    return _plan(
        [
            Change("node1", "toolchain", "packages", "no-op"),
            Change(
                "node1", "llama_cpp", "build", "replace",
                diffs=[
                    AttrDiff("ref", "b7000", "b11312", forces_replacement=True),
                    AttrDiff("commit", "5e1a3c2", known_after_apply=True),
                    AttrDiff("backend", "cpu", "cpu"),
                    AttrDiff("targets", ["llama-server", "ggml-rpc-server"],
                             ["llama-server", "ggml-rpc-server"]),
                ],
                reason="pin moved b7000 -> b11312",
            ),
            Change(
                "node1", "models", "gguf[gemma]", "create",
                diffs=[
                    AttrDiff("path", None, "/var/lib/meshdeploy/models/gemma-3-270m-q4_k_m.gguf"),
                    AttrDiff("sha256", None,
                             "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
                    AttrDiff("size", None, 253113024),
                ],
                reason="model file absent",
            ),
            Change(
                "node1", "services", "llama_server[8080]", "update",
                diffs=[
                    AttrDiff("rpc", ["10.200.0.12:50052"],
                             ["10.200.0.12:50052", "10.200.0.13:50052"]),
                    AttrDiff("api_key", "old-key", "new-key", sensitive=True),
                    AttrDiff("enabled", True, True),
                ],
                reason="unit file differs",
                unit_diff=UNIT_DIFF,
            ),
            Change("node2", "toolchain", "packages", "no-op"),
            Change(
                "node2", "services", "rpc_server[50052]", "create",
                diffs=[
                    AttrDiff("port", None, 50052),
                    AttrDiff("host", None, "10.200.0.12"),
                    AttrDiff("cache", None, True),
                ],
                reason="not running",
            ),
            Change(
                "node3", "services", "rpc_server[50053]", "delete",
                diffs=[AttrDiff("port", 50053, None), AttrDiff("cache", True, None)],
                reason="no longer in inventories/lab.yaml",
            ),
            Change(
                "node3", "services", "rpc_server[50052]", "create",
                diffs=[AttrDiff("port", None, 50052), AttrDiff("host", None, "10.200.0.13")],
                reason="not running",
            ),
        ],
        hosts=["node1", "node2", "node3"],
        warnings=["node3 has 2 GB of memory; the model needs about 0.3 GB per worker"],
        # node1 downloads gemma; node2 fetches its share of the tensors from node1's copy.
        transfers=[TransferRow("node1", 253113024, 0, 253113024, 12_300_000_000),
                   TransferRow("node2", 0, 102_400_000, 102_400_000, None)],
        created_at="2025-01-01T00:00:00Z",
        meshdeploy_version="0.1.0",
    )


def _golden(name: str, actual: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(actual + "\n")
    assert path.exists(), f"{path} missing: run with MESHDEPLOY_UPDATE_GOLDEN=1"
    assert actual + "\n" == path.read_text()


# --- text rendering -----------------------------------------------------------------------


def test_golden_multi_host_text():
    _golden("multi_host.txt", render_text(realistic_plan()))


def test_golden_multi_host_json():
    _golden("multi_host.json", render_json(realistic_plan()))


def test_color_only_adds_ansi_codes():
    p = realistic_plan()
    colored = render_text(p, color=True)
    assert "\x1b[32m+\x1b[0m" in colored  # green create
    assert "\x1b[33m~\x1b[0m" in colored  # yellow update
    assert "\x1b[31m-\x1b[0m/\x1b[32m+\x1b[0m" in colored  # red/green replace
    assert "\x1b[" not in render_text(p)
    assert strip_ansi(colored) == render_text(p)


def test_creates_only():
    p = _plan([
        Change("node2", "services", "rpc_server[50052]", "create",
               diffs=[AttrDiff("port", None, 50052), AttrDiff("threads", None, 2)]),
        Change("node2", "models", "gguf[gemma]", "create",
               diffs=[AttrDiff("commit", known_after_apply=True)]),
    ])
    text = render_text(p)
    lines = text.splitlines()
    assert lines[0] == "Resource actions are indicated with the following symbols:"
    assert lines[1] == "  + create"
    assert lines[2] == ""
    assert "meshdeploy will perform the following actions:" in lines
    assert "  # node2/services.rpc_server[50052] will be created" in lines
    assert '  + resource "services.rpc_server[50052]" {' in lines
    assert "      + port    = 50052" in lines  # "=" aligned on the longest name
    assert "      + threads = 2" in lines
    assert "      + commit = (known after apply)" in lines
    assert lines[-1] == "Plan: 2 to add, 0 to change, 0 to destroy."
    assert p.counts() == {"add": 2, "change": 0, "destroy": 0}


def test_update_with_known_after_apply_and_hidden_unchanged():
    p = _plan([
        Change("node1", "llama_cpp", "build", "update",
               diffs=[AttrDiff("commit", "0c1e570", known_after_apply=True),
                      AttrDiff("backend", "cpu", "cpu"),
                      AttrDiff("jobs", 1, 2)],
               reason="build flags changed"),
    ])
    lines = render_text(p).splitlines()
    assert lines[1] == "  ~ update in-place"
    assert "  # node1/llama_cpp.build will be updated in-place" in lines
    assert "  # (build flags changed)" in lines
    assert '  ~ resource "llama_cpp.build" {' in lines
    assert '      ~ commit = "0c1e570" -> (known after apply)' in lines
    assert "      ~ jobs   = 1 -> 2" in lines
    assert "        # (1 unchanged attribute hidden)" in lines
    assert not any("backend" in line for line in lines)
    assert lines[-1] == "Plan: 0 to add, 1 to change, 0 to destroy."


def test_replace_forces_replacement_counts_add_and_destroy():
    p = _plan([
        Change("node1", "llama_cpp", "build", "replace",
               diffs=[AttrDiff("ref", "b7000", "b11312", forces_replacement=True),
                      AttrDiff("commit", "0c1e570", known_after_apply=True)],
               reason="pin moved b7000 -> b11312"),
    ])
    lines = render_text(p).splitlines()
    assert lines[1] == "-/+ destroy and then create replacement"
    assert "  # node1/llama_cpp.build must be replaced" in lines
    assert '-/+ resource "llama_cpp.build" {' in lines
    assert '      ~ ref    = "b7000" -> "b11312" # forces replacement' in lines
    assert '      ~ commit = "0c1e570" -> (known after apply)' in lines
    assert lines[-1] == "Plan: 1 to add, 0 to change, 1 to destroy."


def test_deletes_and_sensitive_values():
    p = _plan([
        Change("node3", "services", "rpc_server[50053]", "delete",
               diffs=[AttrDiff("port", 50053, None),
                      AttrDiff("token", "hunter2", None, sensitive=True)]),
    ])
    text = render_text(p)
    lines = text.splitlines()
    assert lines[1] == "  - destroy"
    assert "  # node3/services.rpc_server[50053] will be destroyed" in lines
    assert '  - resource "services.rpc_server[50053]" {' in lines
    assert "      - port  = 50053 -> null" in lines
    assert "      - token = (sensitive value) -> null" in lines
    assert "hunter2" not in text
    assert lines[-1] == "Plan: 0 to add, 0 to change, 1 to destroy."


def test_no_changes():
    p = _plan([Change("node1", "toolchain", "packages", "no-op"),
               Change("node2", "services", "rpc_server[50052]", "no-op")])
    text = render_text(p)
    lines = text.splitlines()
    assert not p.has_changes()
    assert "Resource actions" not in text
    assert "will perform" not in text
    assert "resource" not in text
    assert lines[-1] == "No changes. The cluster matches the configuration."
    table = [line.split() for line in lines if line.startswith("node")]
    assert table == [["node1", "0", "0", "0", "1"], ["node2", "0", "0", "0", "1"]]


def test_legend_lists_only_present_actions():
    p = _plan([
        Change("a", "services", "x", "delete"),
        Change("a", "services", "y", "create"),
        Change("a", "services", "z", "no-op"),
    ])
    text = render_text(p)
    start = text.index("symbols:\n") + len("symbols:\n")
    legend = text[start:text.index("\n\n", start)].splitlines()
    # Terraform's order, not the order of the changes.
    assert legend == ["  + create", "  - destroy"]


def test_changes_grouped_by_host_in_cluster_order():
    p = _plan(
        [Change("b", "services", "s1", "create"), Change("a", "services", "s2", "create"),
         Change("b", "services", "s3", "create")],
        hosts=["a", "b"],
    )
    heads = [line for line in render_text(p).splitlines() if line.startswith("  # ")]
    assert heads == ["  # a/services.s2 will be created", "  # b/services.s1 will be created",
                     "  # b/services.s3 will be created"]


def test_warnings_come_before_summary_line():
    p = _plan([Change("a", "services", "s", "create")], warnings=["first\nsecond line"])
    lines = render_text(p).splitlines()
    i = lines.index("Warning: first")
    assert lines[i + 1] == "  second line"
    assert i < len(lines) - 1 and lines[-1].startswith("Plan: ")


def test_unknown_action_is_rejected():
    with pytest.raises(ValueError, match="'modify' is not one of create, update"):
        Change("a", "services", "s", "modify")


# --- JSON -----------------------------------------------------------------------------------


def test_render_json_content_and_redaction():
    doc = json.loads(render_json(realistic_plan()))
    assert doc["format_version"] == 2
    assert doc["counts"] == {"add": 4, "change": 1, "destroy": 2}
    assert doc["hosts"] == ["node1", "node2", "node3"]
    assert doc["warnings"] and doc["has_changes"] is True
    by_addr = {c["address"]: c for c in doc["changes"]}
    assert by_addr["node1/llama_cpp.build"]["action"] == "replace"
    assert by_addr["node1/toolchain.packages"]["action"] == "no-op"
    key = next(d for d in by_addr["node1/services.llama_server[8080]"]["diffs"]
               if d["name"] == "api_key")
    assert key["sensitive"] and key["before"] is None and key["after"] is None
    assert "new-key" not in render_json(realistic_plan())


def test_render_json_is_stable():
    a, b = render_json(realistic_plan()), render_json(realistic_plan())
    assert a == b
    assert a == json.dumps(json.loads(a), sort_keys=True, indent=2, ensure_ascii=False)


def test_to_dict_from_dict_identity():
    p = realistic_plan()
    p.commit, p.commit_source, p.limit = "f" * 40, "lock file", ["node1", "node2"]
    p.remote_commands, p.seconds = {"node1": 1, "node2": 1}, 2.5
    d = p.to_dict()
    assert d["format_version"] == 2
    assert [t["host"] for t in d["transfers"]] == ["node1", "node2"]
    again = Plan.from_dict(json.loads(json.dumps(d)))
    assert again == p
    assert again.to_dict() == d


# --- plan files -----------------------------------------------------------------------------


def test_save_load_mode_0600(tmp_path):
    p = realistic_plan()
    out = tmp_path / "lab.plan"
    old = os.umask(0o022)
    try:
        save_plan(p, out)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert load_plan(out) == p
    assert "new-key" in out.read_text()  # apply needs the secret; hence 0600
    assert sorted(os.listdir(tmp_path)) == ["lab.plan"]  # no temp file left behind


def test_save_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "lab.plan"
    save_plan(realistic_plan(), out)
    before = out.read_bytes()

    def boom(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(files_mod.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        save_plan(_plan([Change("x", "services", "s", "create")]), out)
    assert out.read_bytes() == before  # the old plan survives a failed write intact
    assert sorted(os.listdir(tmp_path)) == ["lab.plan"]


def test_save_replaces_existing_file(tmp_path):
    out = tmp_path / "lab.plan"
    out.write_text("old")
    out.chmod(0o644)
    save_plan(realistic_plan(), out)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert load_plan(out).cluster_name == "lab"


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x89PNG\r\n\x1a\n\x00\xff garbage", "not a meshdeploy plan file (not JSON)"),
        (b"cluster: lab\nhosts: {}\n", "not a meshdeploy plan file (not JSON)"),
        (b'{"cluster": "lab"}', "not a meshdeploy plan (no format_version)"),
        (b'{"format_version": 99}', "plan format 99 is not supported"),
        (b'{"format_version": 1, "extra": {}}', "plan format 1 is not supported"),
        (b'{"format_version": 2, "cluster_name": "lab"}', "plan: missing key 'cluster_path'"),
    ],
)
def test_load_bad_file_gives_one_clear_error(tmp_path, content, message):
    f = tmp_path / "bad.plan"
    f.write_bytes(content)
    with pytest.raises(PlanError) as e:
        load_plan(f)
    assert str(e.value).startswith(f"{f}: {message}")
    assert "\n" not in str(e.value)
    assert e.value.hint


def test_load_rejects_bad_change_inside_valid_file(tmp_path):
    d = realistic_plan().to_dict()
    d["changes"][1]["action"] = "rebuild"
    d["changes"][2]["diffs"][0]["colour"] = "red"
    f = tmp_path / "p.plan"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"changes\[1\]\.action: 'rebuild' is not one of"):
        load_plan(f)
    d["changes"][1]["action"] = "replace"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"changes\[2\]\.diffs\[0\]: unknown key 'colour'"):
        load_plan(f)


def test_load_missing_file(tmp_path):
    with pytest.raises(PlanError, match="plan file not found"):
        load_plan(tmp_path / "nope.plan")


# --- freshness ------------------------------------------------------------------------------


def test_check_fresh_passes_when_nothing_moved():
    p = realistic_plan()
    check_fresh(p, p.config_hash, dict(p.fingerprints))
    # Hosts outside the plan (e.g. a --limit run) do not make it stale.
    check_fresh(p, p.config_hash, {**p.fingerprints, "node9": "f" * 64})


def test_check_fresh_names_drifted_host():
    p = realistic_plan()
    now = dict(p.fingerprints, node2="e" * 64)
    with pytest.raises(StalePlanError) as e:
        check_fresh(p, p.config_hash, now)
    assert str(e.value) == "node2 changed since the plan was made (facts differ): run plan again"


def test_check_fresh_names_config():
    p = realistic_plan()
    with pytest.raises(StalePlanError) as e:
        check_fresh(p, "d" * 64, dict(p.fingerprints))
    assert str(e.value) == (
        "inventories/lab.yaml changed since the plan was made: run plan again"
    )


def test_check_fresh_names_config_and_hosts_and_missing():
    p = realistic_plan()
    now = {"node1": "e" * 64, "node2": p.fingerprints["node2"]}
    with pytest.raises(StalePlanError) as e:
        check_fresh(p, "d" * 64, now)
    msg = str(e.value)
    assert msg.startswith("inventories/lab.yaml changed since the plan was made; ")
    assert "node1 changed since the plan was made (facts differ)" in msg
    assert "node3: no facts gathered now" in msg
    assert "node2" not in msg


# --- helpers --------------------------------------------------------------------------------


def test_hash_files_and_fingerprint(tmp_path):
    a, b = tmp_path / "lab.yaml", tmp_path / "lab.lock"
    a.write_text("cluster: lab\n")
    h1 = hash_files([a, b])
    b.write_text("")
    assert hash_files([a, b]) != h1  # an empty lock file is not the same as none
    a.write_text("cluster: lab2\n")
    assert hash_files([a, b]) != h1
    assert fingerprint({"a": 1, "b": [2]}) == fingerprint({"b": [2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


def test_apply_summary_table():
    text = render_apply_summary([
        {"host": "node1", "step": "llama_cpp.build", "status": "changed", "detail": "b11312"},
        {"host": "node2", "step": "services.rpc_server[50052]", "status": "ok"},
    ])
    lines = text.splitlines()
    assert lines[0].split() == ["host", "step", "status", "detail"]
    assert lines[2].split() == ["node1", "llama_cpp.build", "changed", "b11312"]
    assert lines[3].split() == ["node2", "services.rpc_server[50052]", "ok"]
    assert all(line == line.rstrip() for line in lines)
    with pytest.raises(ValueError, match="unknown key 'stauts'"):
        render_apply_summary([{"host": "a", "stauts": "ok"}])
    assert render_apply_summary([]) == "Apply complete: nothing was run."
