"""core/shell.py: every value comes back from the shell exactly as it went in."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from meshdeploy.core import shell
from meshdeploy.errors import PlanError

ROOT = Path(__file__).resolve().parents[2]

HOSTILE = ["plain", "two words", "", "'", "a'b", '"', "$(touch PWNED)", "`touch PWNED`",
           "; touch PWNED", "a && touch PWNED", "x\ntouch PWNED", "100%", "%h", "$HOME",
           "${HOME}", "-rf", "--upload-pack=touch PWNED", "*", "~", "é ü ß 日本", "\\", "a\\",
           "\t", "\r", "!", "#c", "MESHDEPLOY_EOF", "<<", "|", ">x"]


def bash(script: str, cwd: Path) -> bytes:
    out = subprocess.run(["bash", "-c", script], capture_output=True, cwd=cwd, timeout=20,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("value", HOSTILE)
def test_command_round_trips_through_shlex(value):
    argv = ["prog", value, "--", value]
    assert shlex.split(shell.command(*argv)) == argv


def test_raw_operators_stay_operators():
    text = shell.command("a", "x y", shell.AND, "b", shell.QUIET, shell.THEN, "c", shell.OR, "d")
    assert text == "a 'x y' && b 2>/dev/null; c || d"
    with pytest.raises(TypeError):
        shell.quote(shell.Raw("&&"))


def test_script_variables_arrive_intact(tmp_path):
    values = {f"V{i}": v for i, v in enumerate(HOSTILE)}
    body = "printf '%s\\0' " + " ".join(f'"${k}"' for k in values) + ' "$@"'
    out = bash(shell.script(body, args=HOSTILE, **values), tmp_path)
    assert out.split(b"\0")[:-1] == [v.encode() for v in [*values.values(), *HOSTILE]]
    assert not (tmp_path / "PWNED").exists()


def test_script_refuses_bad_names_and_nul():
    with pytest.raises(ValueError):
        shell.script("true", **{"A-B": "x"})
    with pytest.raises(PlanError, match="NUL"):
        shell.command("echo", "a\0b")
    with pytest.raises(PlanError, match="Unicode"):
        shell.command("echo", "\udcff")


def test_write_file_carries_any_content(tmp_path):
    content = "".join(HOSTILE) + "\nMESHDEPLOY_EOF\nMESHDEPLOY_EOF_\n$(touch PWNED)\n"
    target = tmp_path / "d i r" / "f'ile"
    bash(shell.write_file(str(target), content, "0600"), tmp_path)
    assert target.read_bytes().decode() == content
    assert oct(target.stat().st_mode & 0o777) == "0o600"
    assert not (tmp_path / "PWNED").exists()
    with pytest.raises(ValueError):
        shell.write_file("/x", "y", "0644; touch PWNED")


def test_sudo_wraps_the_script_as_one_word():
    script = "echo 'a' \"$X\"; touch PWNED"
    assert shlex.split(shell.sudo(script)) == ["sudo", "-n", "sh", "-c", script]


def test_only_core_shell_quotes_for_the_shell():
    """One shell layer: no shlex, no private quoting helper anywhere else in the package (the lab
    tool apart: it is not the product)."""
    offenders = []
    package = ROOT / "meshdeploy"
    paths = [p for p in package.rglob("*.py") if package / "lab" not in p.parents]
    assert len(paths) > 80, "the package was not found"
    for path in paths:
        if path == package / "core" / "shell.py" or "templates" in path.parts:
            continue
        text = path.read_text()
        if re.search(r"\bshlex\b|\bdef q\(|\bpipes\.quote", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, offenders


def test_systemd_run_words_after_the_double_dash_reach_the_unit_unexpanded(tmp_path):
    """systemd expands ${VAR} in a unit's command line and reads $$ as $ (systemd 252, checked
    in the lab: `systemd-run --pipe /bin/echo 'a$$b ${HOME}'` prints `a$b ` ); md_systemd_run
    writes each word after `--` so that this reading gives it back exactly."""
    stub = tmp_path / "systemd-run"
    stub.write_text('#!/bin/sh\nfor a; do printf "%s\\0" "$a"; done\n')
    stub.chmod(0o755)
    words = ["/bin/sh", "-c", 'D=/x/y\nP=${D%/*}; echo "$P" $$ ${HOME}\n', "p$q", "end\n\n"]
    got = subprocess.run(["sh", "-c", shell.SYSTEMD_RUN + "\nmd_systemd_run -p 'A=$1' -- \"$@\"",
                          "sh", *words], capture_output=True, text=True,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, check=True).stdout
    argv = got.split("\0")[:-1]
    assert argv[:3] == ["-p", "A=$1", "--"]  # options are not rewritten
    assert argv[3:] != words  # "$" doubled: without it systemd would expand ${D%/*}
    assert [w.replace("$$", "$") for w in argv[3:]] == words


def test_template_sends_the_body_without_its_header_and_lint_directives(tmp_path):
    """A .sh template's leading comment (what it does, its inputs) and its shellcheck
    directives are for readers and the linter; the host gets the body, other comments kept."""
    path = tmp_path / "t.sh"
    path.write_text("# Say X. Inputs: X.\n#\n\nset -e\n# why: kept\n"
                    "  # shellcheck disable=SC2086 # split on purpose\necho $X\n")
    assert shell.body(path) == "set -e\n# why: kept\necho $X"
    assert shell.template(path, X="a b") == "X='a b'\nset -e\n# why: kept\necho $X"
    assert bash(shell.template(path, X="a b"), tmp_path) == b"a b\n"
