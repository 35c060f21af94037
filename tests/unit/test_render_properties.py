"""Property tests: hostile values in every field a renderer reads never escape their quoting.

The values are put straight into the model objects (dataclasses.replace), not through validate:
this layer must be safe for any string the model can hold. The rendering and the checks live
in tests/support/render_check.py (shared with the soak, benchmarks/fuzz_render.py): bash -n on every
command, every quoted word read back by bash, the sentinel PWNED nowhere outside quoted words
and heredoc bodies, units read back by tests/support/systemd_parse.py, plists by plistlib. Only
PlanError may be raised.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import render_check as rc
from support.accounts import load_inventory

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import shell
from meshdeploy.roles.llama_cpp import settings as llama_cpp_settings

ROOT = Path(__file__).resolve().parents[2]
PARTS = ["a", "b", " ", "'", '"', "$(touch PWNED)", "`touch PWNED`", "; touch PWNED",
         "&& touch PWNED", "\n", "%h", "%%", "$HOME", "${X}", "$$", "-", "--x=", "\\", "é",
         "日", "]]>", "<", "&", "|", "*", "?", "~", "\t", "\r", "MESHDEPLOY_EOF", "#", "=", ":",
         "/", "..", "\x7f", "\u2028"]
VALUE = st.one_of(st.lists(st.sampled_from(PARTS), max_size=6).map("".join),
                  st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
                          max_size=8))
FIELDS = st.fixed_dictionaries({
    k: VALUE for k in ("bind", "extra", "repo", "ref", "prefix", "file", "api_key", "device",
                       "ccache", "proxy", "rpc_bind", "path")})


@pytest.fixture(scope="module")
def lab():
    return load_cluster(ROOT / "inventories" / "lab.yaml")


def hostile_cluster(lab, v):
    mine = llama_cpp_settings.of(lab)
    lab = llama_cpp_settings.with_settings(lab, dataclasses.replace(
        mine, repo=v["repo"], ref=v["ref"], prefix="/" + v["prefix"],
        build=dataclasses.replace(mine.build, ccache_dir="/" + v["ccache"],
                                  cmake_flags=("-DX=" + v["extra"],))))
    node2 = lab.host("node2")
    rpc = dataclasses.replace(node2.rpc_servers[0], bind=v["rpc_bind"], device=v["device"],
                              cache=True)
    hosts = (lab.hosts[0], dataclasses.replace(node2, rpc_servers=(rpc,)), lab.hosts[2])
    server = dataclasses.replace(lab.servers[0], bind=v["bind"], extra_args=(v["extra"], "-x"),
                                 api_key_file="/" + v["api_key"])
    src = lab.models["gemma"].source
    gemma = dataclasses.replace(lab.models["gemma"], source=dataclasses.replace(
        src, files=(v["file"] or "f",)))
    return dataclasses.replace(lab, hosts=hosts, servers=(server,),
                               models={"gemma": gemma},
                               sections={**lab.sections, "toolchain": {"apt_proxy": v["proxy"]}})


def hostile_extras(v) -> rc.Extras:
    return rc.Extras(url_path=v["path"], seed_tool="/" + v["prefix"] + "/tool",
                     seed_cache="/" + v["path"], seed_model="/" + v["file"])


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(FIELDS)
def test_hostile_values_never_escape(lab, tmp_path, v):
    cluster = hostile_cluster(lab, v)
    rendered = rc.render_all(cluster, hostile_extras(v))
    assert rendered.commands and rendered.words
    assert rc.check(cluster, rendered, tmp_path) == []


def test_every_inventory_renders_clean(tmp_path):
    for path in sorted((ROOT / "inventories").glob("*.yaml")):
        cluster = load_inventory(path)
        rendered = rc.render_all(cluster)
        assert rendered.commands, path
        assert rc.check(cluster, rendered, tmp_path) == [], path


# The checker must be able to fail: each of these is an escape it has to name.

def test_unquoted_value_is_caught(tmp_path):
    value = "x; touch PWNED"
    quoted = shell.quote("safe")
    command = f"mkdir -p {quoted} && cd {value}"
    findings = rc.check_commands([command], [("safe", quoted)], tmp_path)
    assert len(findings) == 1 and "PWNED outside a quoted word" in findings[0]
    assert command in findings[0]


def test_command_that_does_not_parse_is_caught(tmp_path):
    findings = rc.check_commands(["echo 'unterminated"], [], tmp_path)
    assert findings and findings[0].startswith("bash -n refuses it")


def test_quoted_word_that_reads_back_wrong_is_caught(tmp_path):
    # Double quotes do not stop $(...): the read-back runs it in the scratch folder.
    value = "$(touch PWNED)"
    findings = rc.check_commands([f'echo "{value}"'], [(value, f'"{value}"')], tmp_path)
    assert any("reads back differently" in f for f in findings)
    assert any("created" in f for f in findings)


def test_unit_with_injected_argument_is_caught(lab):
    server = lab.servers[0]
    unit = rc.unit_files.server_unit(lab, lab.hosts[0], server, "/opt/b", None, "a" * 64)
    assert rc.check_units(lab, [(server, unit)]) == []
    bad = unit.replace("ExecStart=", "ExecStart=/bin/sh -c x ", 1)
    assert rc.check_units(lab, [(server, bad)])


def test_systemd_parse_semicolons():
    # fuzz_render seed 392: a prefix "/var/lib/my ; touch PWNED/x" is one quoted word in
    # ExecStart, not a command separator; only an unquoted lone ";" separates.
    assert rc.sd.exec_argv('/bin/x "/a ; b" c') == ["/bin/x", "/a ; b", "c"]
    assert rc.sd.exec_argv("/bin/x a; b") == ["/bin/x", "a;", "b"]
    for value in ("/bin/x ; /bin/y", "/bin/x a ;"):
        with pytest.raises(ValueError, match="lone ;"):
            rc.sd.exec_argv(value)
