"""What a host sends never drives the operator's terminal (security review, issue 20): `logs`
and `exec` show C0 controls (but tab and newline), DEL and C1 controls (U+009B CSI, U+009D OSC)
as escapes, through one helper, errors.terminal_text. exec runs for real on a `connection: local`
host; journal lines go through the parser as journalctl's JSON gives them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshdeploy.cli import main
from meshdeploy.commands import logs
from meshdeploy.core.loading import load_cluster
from meshdeploy.core import registry
from meshdeploy.errors import terminal_text
from meshdeploy.views.log_lines import HostStream, parse
from meshdeploy.views.logs import render

REPO = Path(__file__).resolve().parents[2]
# Anything a terminal would act on: what must never reach it from a host.
ACTIVE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# A clipboard write (OSC 52), a title change, 8-bit CSI and OSC, a colour, DEL, a carriage return
# that would overwrite the line, and a tab, which stays.
HOSTILE = ("a\x1b]52;c;cHduZWQ=\x07b \x9b31mred\x9d0;title\x9c \x1b[2J\x7f\r\tend")
SHOWN = "a\\x1b]52;c;cHduZWQ=\\x07b \\x9b31mred\\x9d0;title\\x9c \\x1b[2J\\x7f\\r\tend"


def test_terminal_text_escapes_every_control_but_tab_and_newline():
    assert terminal_text(HOSTILE) == SHOWN
    assert terminal_text("two\nlines\tand tabs, ümlauts, \u00a0, \ufffd") == \
        "two\nlines\tand tabs, ümlauts, \u00a0, \ufffd"
    every = "".join(map(chr, range(0x00, 0xa0)))
    assert not ACTIVE.search(terminal_text(every).replace("\t", "").replace("\n", ""))


@pytest.fixture(scope="module")
def sources():
    return registry.log_sources(load_cluster(REPO / "inventories" / "lab.yaml"))


def _entry(t, message):
    return json.dumps({"__REALTIME_TIMESTAMP": str(t), "MESSAGE": message, "__CURSOR": f"c{t}",
                       "_SYSTEMD_UNIT": "meshdeploy-server-main.service"})


def test_journal_lines_with_c1_and_escape_sequences_are_shown_escaped(sources):
    stream = HostStream("node1", 0, [sources[0]])
    raw = list(f"x{HOSTILE}".encode())  # journalctl gives non-UTF-8 messages as byte lists
    out = "\n".join(["@unit meshdeploy-server-main", _entry(1, HOSTILE),
                     _entry(2, raw + [0xff])])
    lines = parse(stream, out)
    assert [line.text for line in lines] == [SHOWN, "x" + SHOWN + "\ufffd"]
    assert not any(ACTIVE.search(render(line, 20).replace("\t", "")) for line in lines)


def test_launchd_log_lines_are_shown_escaped(sources):
    mac = HostStream("mac", 0, sources[:1])
    mac.feed("@launchd")
    mac.feed("@unit meshdeploy-server-main")
    (line,) = mac.feed(HOSTILE, now=5)
    assert line.text == SHOWN


ONLY_LOCAL = ("cluster: t\nllama_cpp: {ref: b11312}\n"
              "hosts:\n  here:\n    address: 127.0.0.1\n    connection: local\n")


def test_exec_output_of_a_failing_command_is_shown_escaped(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(ONLY_LOCAL)
    # printf's octal escapes: the bytes reach exec's output as a host would send them.
    command = (r"printf 'a\033]52;c;cHduZWQ=\007b \302\23331mred\302\2350;title\302\234 "
               r"\033[2J\177\r\tend\n'; exit 3")
    assert main(["exec", str(path), "--", command]) == 1
    out = capsys.readouterr().out
    assert SHOWN + "\n" in out
    assert not ACTIVE.search(out.replace("\t", "").replace("\n", ""))


def test_failure_lines_and_unreachable_reasons_are_shown_escaped(capsys):
    # Only their last (first) line is shown: a CR would split them there.
    hostile, shown = HOSTILE.replace("\r", ""), SHOWN.replace("\\r", "")
    failed = SimpleNamespace(exited=1, stdout="", stderr=f"journalctl: {hostile}\n")
    assert logs._failed("node2", failed)
    assert logs._failed("node3", OSError(f"banner {hostile}"))
    err = capsys.readouterr().err
    assert f"node2: reading the logs failed (exit 1): journalctl: {shown}" in err
    assert f"node3: unreachable (banner {shown})" in err
    assert not ACTIVE.search(err.replace("\t", "").replace("\n", ""))


def test_every_error_the_cli_prints_is_made_inert(capsys):
    """An apply's error quotes the hosts' stderr (a seeding step's comes from a service's user):
    the CLI prints every MeshdeployError and internal error through terminal_text."""
    from meshdeploy import cli
    from meshdeploy.errors import ApplyError

    def failing():
        raise ApplyError(f"node2: rpc_cache.seed[50052] failed:\n    {HOSTILE}", hint="fix it")

    def crashing():
        raise RuntimeError(HOSTILE)

    for work in (failing, crashing):
        code = cli.guarded(work, debug=False, verbose=False)
        err = capsys.readouterr().err
        assert code != 0 and SHOWN in err, err
        assert not ACTIVE.search(err.replace("\t", "").replace("\n", ""))


def test_live_progress_shows_a_hosts_label_inert():
    from meshdeploy.core import progress
    from meshdeploy.views import progress as progress_view

    event = progress.parse(f"{progress.MARKER} download 10 20 0 model\x1b]52;c;x\x07")
    assert event is not None and "\x1b" in event.label
    h = progress.HostProgress("node2", "models.gguf[m]", since=0.0, event=event)
    line = progress_view.describe(h, 5.0)
    assert "model\\x1b]52;c;x\\x07" in line and not ACTIVE.search(line), line
    # "³" is a digit to str.isdigit() and not to int(): the line is ignored, nothing raises.
    assert progress.parse(f"{progress.MARKER} seed ³ 20 model") is None
