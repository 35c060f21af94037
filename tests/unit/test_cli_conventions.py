"""The conventions of the tools operators know: --version, NO_COLOR and --no-color, Terraform's
single-dash spellings, a usage error with the command's own usage, and a JSON cluster file told
apart from a saved plan by what it says, not by its first byte."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
from support.cli import meshdeploy

from meshdeploy import cli
from meshdeploy.commands import apply, common

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "inventories" / "lab.yaml"


def test_version_names_the_project_and_pyproject_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = meshdeploy("--version")
    assert out.returncode == 0 and out.stdout == f"meshdeploy {version}\n"


@pytest.mark.parametrize("command,single,double,dest", [
    ("apply", "-auto-approve", "--auto-approve", "auto_approve"),
    ("destroy", "-auto-approve", "--auto-approve", "auto_approve"),
    ("plan", "-detailed-exitcode", "--detailed-exitcode", "detailed_exitcode"),
    ("plan", "-no-color", "--no-color", "no_color"),
    ("status", "-no-color", "--no-color", "no_color"),
])
def test_terraform_single_dash_spellings_mean_the_double_dash_ones(command, single, double, dest):
    parser = cli.build_parser()
    plain = parser.parse_args([command, "f.yaml"])
    assert getattr(plain, dest) is False
    for spelling in (single, double):
        assert getattr(parser.parse_args([command, "f.yaml", spelling]), dest) is True


def test_no_color_turns_colour_off_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert common.color()
    monkeypatch.setenv("NO_COLOR", "")  # no-color.org: set and empty does not count
    assert common.color()
    monkeypatch.setenv("NO_COLOR", "1")
    assert not common.color()


def test_the_no_color_flag_sets_no_color_for_the_views(monkeypatch, tmp_path):
    monkeypatch.delenv("NO_COLOR", raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: x\n")
    # The run fails at validation; the flag has been taken by then.
    assert cli.main(["validate", str(bad), "--no-color"]) != 0
    assert cli.os.environ.get("NO_COLOR") == "1"
    monkeypatch.delenv("NO_COLOR")


def test_a_usage_error_prints_the_commands_own_usage():
    out = meshdeploy("plan", LAB, "--no-such-flag")
    assert out.returncode == 1
    assert out.stderr.startswith("usage: meshdeploy plan ")
    assert "meshdeploy plan: error: unrecognized arguments: --no-such-flag" in out.stderr


def test_a_json_cluster_file_is_not_taken_for_a_saved_plan(tmp_path):

    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"cluster": "c", "llama_cpp": {"ref": "b1"}, "hosts": {}}))
    saved = tmp_path / "saved.plan"
    saved.write_text(json.dumps({"format_version": "1.0", "changes": []}))
    damaged = tmp_path / "damaged.plan"
    damaged.write_text('{"format_version": "1.0", "changes": [')
    yaml = tmp_path / "c.yaml"
    yaml.write_text("cluster: c\n")
    assert not apply._is_plan_file(str(cluster))
    assert apply._is_plan_file(str(saved))
    assert apply._is_plan_file(str(damaged))  # load_plan says what is wrong with it
    assert not apply._is_plan_file(str(yaml))
    assert not apply._is_plan_file(str(tmp_path / "missing"))


def test_a_json_cluster_file_given_to_apply_is_validated_as_a_cluster_file(tmp_path):
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"cluster": "c", "hosts": []}\n')
    out = meshdeploy("apply", cluster, "--auto-approve")
    assert out.returncode != 0
    # Read as a saved plan before: "not a meshdeploy plan (no format_version)".
    assert "plan" not in out.stderr
    assert out.stderr.startswith(f"{cluster}:1:1: missing required key 'llama_cpp'")


def test_a_list_where_a_mapping_belongs_is_named_once(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: x\nllama_cpp: {ref: b1}\nhosts: [a]\nmodels: {}\nservers: {}\n")
    out = meshdeploy("validate", bad, "--verbose")
    assert "hosts: expected a mapping, got a list\n" in out.stderr


# -- --json answers, on failure too --------------------------------------------------------------

BAD = "cluster: x\nhosts: [a]\nextra: 1\n"


def test_validate_json_of_a_good_file(tmp_path):
    out = meshdeploy("validate", LAB, "--json")
    doc = json.loads(out.stdout)
    assert out.returncode == 0 and out.stderr == ""
    assert doc["valid"] is True and doc["error_count"] == 0 and doc["diagnostics"] == []
    assert (doc["hosts"], doc["rpc_servers"], doc["models"]) == (3, 2, 1)


@pytest.mark.parametrize("command", [["validate"], ["plan"], ["apply", "--auto-approve"],
                                     ["destroy", "--auto-approve"], ["status"], ["bench"]])
def test_a_bad_file_under_json_is_diagnostics_on_stdout_with_the_same_exit_code(command, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    plain = meshdeploy(command[0], bad, *command[1:])
    out = meshdeploy(command[0], bad, *command[1:], "--json")
    assert out.returncode == plain.returncode == 3
    assert out.stderr == ""
    doc = json.loads(out.stdout)
    assert doc["valid"] is False and doc["exit_code"] == 3
    errors_ = [d for d in doc["diagnostics"] if d["severity"] == "error"]
    assert doc["error_count"] == len(errors_) == 3  # every one, not only the first
    assert [d["range"]["start"]["line"] for d in errors_] == [1, 2, 3]  # file order
    assert all(d["range"]["filename"] == str(bad) for d in errors_)
    assert errors_[2]["path"] == "extra" and errors_[2]["detail"].startswith("allowed keys")


def test_an_error_without_a_place_under_json(tmp_path):
    out = meshdeploy("destroy", LAB, "--json")  # --json cannot ask for confirmation
    doc = json.loads(out.stdout)
    assert out.returncode == 1 and doc["exit_code"] == 1 and out.stderr == ""
    assert doc["diagnostics"] == [{"severity": "error",
                                   "summary": "destroy --json cannot ask for confirmation",
                                   "detail": "add --auto-approve"}]


def test_validate_says_the_warnings_that_need_no_host(tmp_path):
    text = LAB.read_text().replace("network:\n  rpc_bind: address\n",
                                   "network:\n  rpc_bind: address\n  firewall: false\n", 1)
    assert "firewall: false" in text
    off = tmp_path / "off.yaml"
    off.write_text(text)
    out = meshdeploy("validate", off)
    assert out.returncode == 0
    assert "warning: network.firewall: false: no host filters its meshdeploy ports" in out.stderr
    doc = json.loads(meshdeploy("validate", off, "--json").stdout)
    assert doc["valid"] and doc["warning_count"] == 1
    assert doc["diagnostics"][0]["severity"] == "warning"
