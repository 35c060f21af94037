"""Commands print only what the views render: no command module writes a text of its own (a
string, an f-string or a sum of them as print()'s argument). Every word the user reads comes
from meshdeploy/views/, where its tests are."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

COMMANDS = Path(__file__).resolve().parents[2] / "meshdeploy" / "commands"


def own_texts(source: str) -> list[int]:
    """Lines where print() is given a text composed in the module itself."""
    def composed(node) -> bool:
        if isinstance(node, ast.JoinedStr):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return True
        if isinstance(node, ast.BinOp):
            return composed(node.left) or composed(node.right)
        return False

    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "print" and any(composed(a) for a in node.args)]


@pytest.mark.parametrize("source, lines", [
    ('print("\\nApplying:")\n', [1]),
    ('print(f"{name}: unreachable", file=sys.stderr)\n', [1]),
    ('print("down" + more)\n', [1]),
    ('print(view.render_text(plan))\nprint(notices.warning(w), file=sys.stderr)\n', []),
])
def test_the_check_tells_a_composed_text_from_a_rendered_one(source, lines):
    assert own_texts(source) == lines


def test_no_command_prints_a_text_of_its_own():
    found = {path.name: own_texts(path.read_text()) for path in sorted(COMMANDS.glob("*.py"))}
    assert {name: lines for name, lines in found.items() if lines} == {}
