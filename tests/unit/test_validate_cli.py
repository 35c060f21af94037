"""`meshdeploy validate` and the error/exit-code contract shared by every subcommand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshdeploy import cli, errors

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "inventories" / "lab.yaml"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshdeploy", *args], capture_output=True,
                          text=True, timeout=60)


def test_valid_file_exits_ok():
    done = run_cli("validate", str(LAB))
    assert done.returncode == errors.OK
    assert done.stdout == f"{LAB}: ok (3 hosts, 2 rpc-servers, 1 model)\n"


def test_config_error_exits_3_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: t\nllama_cpp: {ref: b1}\nhosts:\n  n: {address: 10.0.0.1, "
                   "backend: cudaa, x: 1}\n")
    done = run_cli("validate", str(bad))
    assert done.returncode == errors.CONFIG
    assert "Traceback" not in done.stderr
    # validate shows every error at once, in file order (the column orders one line's).
    errors_shown = [line for line in done.stderr.splitlines() if not line.startswith("  hint")]
    assert len(errors_shown) == 2 and all(e.startswith(f"{bad}:4:") for e in errors_shown)
    columns = [int(e.split(":")[2]) for e in errors_shown]
    assert columns == sorted(columns)
    assert "more error" not in done.stderr
    assert "'cudaa' is not one of cpu, cuda, metal, vulkan, rocm" in done.stderr
    assert "unknown key 'x'" in done.stderr


def test_validate_lists_errors_in_file_order_up_to_a_cap(tmp_path):
    from meshdeploy.views.validate import MOST_ERRORS

    hosts = "".join(f"  h{i}: {{address: 10.0.0.{i}, backend: cpu, typo{i}: 1}}\n"
                    for i in range(MOST_ERRORS + 5))
    bad = tmp_path / "many.yaml"
    bad.write_text(f"cluster: t\nllama_cpp: {{ref: b1}}\nhosts:\n{hosts}")
    done = run_cli("validate", str(bad))
    assert done.returncode == errors.CONFIG
    shown = [line for line in done.stderr.splitlines() if line.startswith(f"{bad}:")]
    assert len(shown) == MOST_ERRORS
    assert [int(line.split(":")[1]) for line in shown] == sorted(int(line.split(":")[1])
                                                                  for line in shown)
    assert shown[0].startswith(f"{bad}:1:") or shown[0].startswith(f"{bad}:4:")
    assert done.stderr.rstrip().endswith("more errors (fix these first)")


def test_other_commands_still_show_the_most_relevant_error_first(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: t\nllama_cpp: {ref: b1}\nhosts:\n  n: {address: 10.0.0.1, "
                   "backend: cudaa, x: 1}\n")
    done = run_cli("plan", str(bad))
    assert done.returncode == errors.CONFIG
    assert done.stderr.splitlines()[-1] == "1 more error (--verbose)"


def test_missing_file_is_a_config_error(tmp_path):
    done = run_cli("validate", str(tmp_path / "nope.yaml"))
    assert done.returncode == errors.CONFIG
    assert "cannot read" in done.stderr and "Traceback" not in done.stderr


def test_usage_error_never_exits_2():
    done = run_cli("plan")
    assert done.returncode == errors.ERROR
    assert "usage:" in done.stderr


def test_public_bind_warning_is_printed(tmp_path):
    f = tmp_path / "pub.yaml"
    f.write_text("cluster: t\nllama_cpp: {ref: b1}\nnetwork: {allow_public: true}\nhosts:\n"
                 "  n: {address: 10.0.0.1, rpc_servers: [{bind: 0.0.0.0}]}\n")
    done = run_cli("validate", str(f))
    assert done.returncode == errors.OK
    assert done.stderr.startswith("warning: rpc-server on n binds every interface")


def test_internal_error_has_no_traceback_unless_debug(monkeypatch, capsys):
    from meshdeploy.commands import validate

    def broken(path):
        raise RuntimeError("boom")

    monkeypatch.setattr(validate, "load_cluster", broken)
    assert cli.main(["validate", str(LAB)]) == errors.ERROR
    err = capsys.readouterr().err
    assert err.startswith("internal error: RuntimeError: boom\nrerun with --debug")
    assert "Traceback" not in err
    assert cli.main(["validate", "--debug", str(LAB)]) == errors.ERROR
    assert "Traceback" in capsys.readouterr().err


@pytest.fixture
def fake_commands(monkeypatch):
    from meshdeploy.commands import apply, plan, status

    calls = []

    def plan_run(args):
        calls.append(("plan", args))
        if args.limit == ["stale"]:
            raise errors.StalePlanError("plan is stale: node2 changed", "run plan again")
        return errors.CHANGES if args.detailed_exitcode else errors.OK

    def apply_run(args):
        calls.append(("apply", args))
        raise KeyboardInterrupt

    def status_run(args):
        calls.append(("status", args))
        raise errors.ConnectError("cannot reach node2", "is it up?")

    monkeypatch.setattr(plan, "run", plan_run)
    monkeypatch.setattr(apply, "run", apply_run)
    monkeypatch.setattr(status, "run", status_run)
    return calls


def test_plan_options_reach_the_engine(fake_commands):
    code = cli.main(["plan", "c.yaml", "--json", "-out", "p.plan", "--detailed-exitcode",
                     "--limit", "node1,node2"])
    assert code == errors.CHANGES
    (name, args), = fake_commands
    assert name == "plan" and args.file == "c.yaml" and args.json and args.out == "p.plan"
    assert args.limit == ["node1", "node2"]


def test_errors_map_to_named_exit_codes(fake_commands, capsys):
    assert cli.main(["plan", "c.yaml", "--limit", "stale"]) == errors.STALE_PLAN
    assert cli.main(["plan", "c.yaml", "--limit", "stale", "--detailed-exitcode"]) == \
        errors.ERROR
    assert cli.main(["apply", "c.yaml", "--auto-approve"]) == errors.INTERRUPTED
    err = capsys.readouterr().err
    assert "plan is stale: node2 changed\n  hint: run plan again" in err and "Traceback" not in err
    # Under --json the error is a diagnostic on stdout, with the same exit code.
    assert cli.main(["status", "c.yaml", "--json"]) == errors.CONNECT
    answered = capsys.readouterr()
    assert answered.err == ""
    assert "cannot reach node2" in json.loads(answered.out)["diagnostics"][0]["summary"]


def test_lab_gets_the_rest_of_argv(monkeypatch):
    import meshdeploy.lab.cli as lab_cli

    seen = []
    monkeypatch.setattr(lab_cli, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["lab", "up", "--hosts", "3"]) == errors.OK
    assert seen == [["up", "--hosts", "3"]]
