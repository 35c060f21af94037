"""The runbook format (docs/runbooks/README.md) without a lab: the parser, and every runbook's
steps parsed, with their cluster-file edits applied to the lab's file and validated.

tests/lab/test_runbooks.py runs the same steps on real hosts."""

from __future__ import annotations

from pathlib import Path

import pytest
from ruamel.yaml import YAML
from support import runbook
from support.runbook import RunbookError, parse_text

from meshdeploy.core.loading import load_cluster

REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks"
NAMES = runbook.order(RUNBOOKS)
# Runbooks whose change a later one undoes: remove-worker.md takes node4 out, rollback.md the pin.
UNDONE_LATER = {"add-worker.md", "upgrade-llama-cpp.md"}


def test_a_block_its_markers_and_an_edit():
    book = parse_text("# Runbook: x\n\nprose `meshdeploy plan` is not a step\n\n"
                      "```sh\nmeshdeploy status cluster.yaml\n```\n\n"
                      "<!-- expect: not listening -->\n<!-- expect-not: Traceback -->\n"
                      "<!-- expect-exit: 1 -->\n\n"
                      "```text\nan illustration\n```\n\n"
                      "```yaml\nservers: {}\n```\n\n"
                      "```yaml\n# cluster.yaml: set servers.main.ctx_size\n4096\n```\n"
                      "```yaml\n# cluster.yaml: delete hosts.node3.rpc_servers.0\n```\n")
    assert book.title == "Runbook: x"
    sh, set_, delete = book.steps
    assert (sh.kind, sh.line, sh.text) == ("sh", 5, "meshdeploy status cluster.yaml\n")
    assert (sh.expect, sh.expect_not, sh.exit_code) == (["not listening"], ["Traceback"], 1)
    assert (set_.action, set_.path, set_.text.strip()) == ("set", ("servers", "main", "ctx_size"),
                                                           "4096")
    assert (delete.action, delete.path) == ("delete", ("hosts", "node3", "rpc_servers", 0))


@pytest.mark.parametrize("text, message", [
    ("x\n<!-- expect: y -->\n", "must follow a ```sh block"),
    ("```sh\nls\n```\nprose\n<!-- expect: y -->\n", "must follow a ```sh block"),
    ("```sh\nls\n```\n<!-- expect-exit: one -->\n", "takes a number"),
    ("```sh\nls\n", "never closed"),
    ("```sh\n\n```\n", "empty ```sh block"),
    ("```yaml\n# cluster.yaml: change a.b\n1\n```\n", "set PATH"),
    ("```yaml\n# cluster.yaml: set a.b\n```\n", "needs the new YAML"),
    ("```yaml\n# cluster.yaml: delete a.b\n1\n```\n", "takes no YAML"),
])
def test_a_malformed_runbook_is_refused_at_its_line(text, message):
    with pytest.raises(RunbookError, match=r"<runbook>:\d+: .*" + message.replace("(", r"\(")
                       .replace("`", "`").replace("*", r"\*")):
        parse_text(text)


def test_every_runbook_is_listed_once_and_has_steps():
    assert set(NAMES) == {p.name for p in RUNBOOKS.glob("*.md")} - {"README.md"}
    for name in NAMES:
        book = runbook.parse(RUNBOOKS / name)
        assert book.title.startswith("Runbook: "), name
        assert any(s.kind == "sh" for s in book.steps), f"{name} has no ```sh step"


def test_edits_apply_to_the_lab_file_and_bring_it_back(tmp_path):
    """In the lab test's order, every edit applies and the file stays valid after each one; the
    runbooks that change the cluster either undo the change or are undone by a later one (as
    README.md says), so the list ends with the file as it began."""
    target = tmp_path / runbook.CLUSTER_FILE
    target.write_text((REPO / "inventories" / "lab.yaml").read_text())
    original = YAML(typ="safe").load(target.read_text())
    edits = 0
    for name in NAMES:
        for step in runbook.parse(RUNBOOKS / name).steps:
            if step.kind == "edit":
                runbook.apply_edit(step, target)
                load_cluster(str(target))  # a config error fails here with file:line
                edits += 1
        now = YAML(typ="safe").load(target.read_text())
        assert (now != original) == (name in UNDONE_LATER), name
    assert YAML(typ="safe").load(target.read_text()) == original
    assert edits >= 10


def test_file_before_a_runbook_has_the_earlier_edits(tmp_path):
    target = tmp_path / runbook.CLUSTER_FILE
    base = (REPO / "inventories" / "lab.yaml").read_text()
    runbook.file_before(RUNBOOKS, "remove-worker.md", target, base)
    assert YAML(typ="safe").load(target.read_text())["hosts"]["node4"]["rpc_servers"]
    runbook.file_before(RUNBOOKS, NAMES[0], target, base)
    assert target.read_text() == base


def test_an_edit_keeps_comments_and_refuses_a_wrong_path(tmp_path):
    target = tmp_path / runbook.CLUSTER_FILE
    target.write_text((REPO / "inventories" / "lab.yaml").read_text())
    (step,) = parse_text("```yaml\n# cluster.yaml: set servers.main.ctx_size\n4096\n```\n").steps
    runbook.apply_edit(step, target)
    text = target.read_text()
    assert "ctx_size: 4096" in text and "# the same mirror, as the control machine" in text
    (bad,) = parse_text("```yaml\n# cluster.yaml: delete hosts.node9.backend\n```\n").steps
    with pytest.raises(RunbookError, match="has no 'node9'"):
        runbook.apply_edit(bad, target)
