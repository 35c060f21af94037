"""No layer outside the roles reads a role's settings, resources or facts by the role's name.

A role owns its section of the cluster file, its resource addresses (`rpc_cache.seed[50052]`)
and its fact keys (`rpc_cache.DeviceMemory`); the layers around the roles (config, core, engine,
execute, views, commands, placement, remote) reach them through the registry and the role's own
interfaces. This scan reads those layers' syntax trees (docstrings aside) and finds where they
name a role anyway:
- a string that starts with a role's name and a dot (a resource address, a fact key, a setting's
  path such as `llama_cpp.ref`, also inside a message);
- a subscript or `.get`/`.pop`/`.setdefault` with a role's name as key (`data["network"]`);
- a tuple or list whose first item is a role's name (a setting's path: `("network", "ssh")`).

KNOWN lists what the scan finds that is not a role's: `models`, the core's own section of the
models (which shares its name with the role that fetches them); it may only shrink. A new finding fails, and so does a
listed one that is gone, so the list stays the code's.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshdeploy"
LAYERS = ("config", "core", "engine", "execute", "views", "commands", "placement", "remote")

# (file, what it names) -> how many times: each the core's own `models:` section of the cluster
# file, whose name the models role shares.
KNOWN = {
    # config/load.py builds the typed model of the core's own `models:` section.
    ("config/load.py", "models"): 1,
    # config/checks.py: `models` is the core's own section (a Hugging Face source's file and
    # files, read from the file as written).
    ("config/checks.py", "models"): 1,
    # config/schema.py: the messages of the core's own patterns of a model's source.
    ("config/schema.py", "models.*.huggingface.revision"): 1,
    ("config/schema.py", "models.*.huggingface.repo"): 1,
    # views/validate.py: validate's summary counts the models ({"models": 1}), read back by key.
    ("views/validate.py", "models"): 1,
}


def role_names() -> list[str]:
    return sorted(p.name for p in (PACKAGE / "roles").iterdir() if (p / "__init__.py").is_file())


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant):
            out.add(id(node.body[0].value))
    return out


def findings(source: str, roles: list[str]) -> list[tuple[int, str]]:
    """(line, the string) for every place `source` names a role (the module docstring's rules)."""
    dotted = re.compile(r"(%s)\.[A-Za-z_*]" % "|".join(map(re.escape, roles)))
    tree = ast.parse(source)
    docs = _docstrings(tree)

    def role(node) -> str | None:
        ok = isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in roles
        return node.value if ok else None

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and role(node.slice):
            out.append((node.lineno, node.slice.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "pop", "setdefault") and node.args and role(node.args[0]):
            out.append((node.lineno, node.args[0].value))
        elif isinstance(node, (ast.Tuple, ast.List)) and node.elts and role(node.elts[0]):
            out.append((node.lineno, node.elts[0].value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in docs and dotted.match(node.value):
            out.append((node.lineno, node.value))
    return out


def scan() -> dict[tuple[str, str], list[int]]:
    roles = role_names()
    found: dict[tuple[str, str], list[int]] = {}
    for layer in LAYERS:
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            if "templates" in path.parts:  # host-side scripts, shipped as files
                continue
            rel = path.relative_to(PACKAGE).as_posix()
            for line, text in findings(path.read_text(), roles):
                found.setdefault((rel, text), []).append(line)
    return found


def test_the_roles_are_found():
    assert {"toolchain", "llama_cpp", "models", "rpc_cache", "services", "network"} <= \
        set(role_names())


@pytest.mark.parametrize("source, named", [
    ('x = facts["h"].get("rpc_cache.DeviceMemory")\n', "rpc_cache.DeviceMemory"),
    ('lc = data["llama_cpp"]\n', "llama_cpp"),
    ('net = data.get("network", {})\n', "network"),
    ('where = doc.issue(("models", name, "huggingface"), "x")\n', "models"),
    ('raise PlanError("llama_cpp.ref is not a commit")\n', "llama_cpp.ref is not a commit"),
    ('def f():\n    """Reads llama_cpp.ref (a docstring)."""\n    return data["llama_cpp"]\n',
     "llama_cpp"),
])
def test_the_scan_finds_a_role_named_in_each_form(source, named):
    assert [text for _, text in findings(source, role_names())] == [named]


@pytest.mark.parametrize("source", [
    'def f():\n    """Reads llama_cpp.ref and data["network"]."""\n',
    'counts = {"models": 1}\n',  # a key written, not a role's section read
    'name = "rpc_cache_marker"\n',  # a role's prefix without a dot
    'word = "networking"\n',
])
def test_the_scan_leaves_docstrings_and_other_words_alone(source):
    assert findings(source, role_names()) == []


def test_no_layer_outside_the_roles_names_a_role_beyond_what_is_known():
    found = {key: len(lines) for key, lines in scan().items()}
    where = {key: lines for key, lines in scan().items()}
    new = {f"{f}:{where[(f, t)]}: {t!r}": n for (f, t), n in found.items()
           if n > KNOWN.get((f, t), 0)}
    assert not new, ("a layer outside the roles names a role (read it through the role's "
                     f"interface instead): {new}")
    gone = {key: n for key, n in KNOWN.items() if found.get(key, 0) < n}
    assert not gone, f"no longer found, take them out of KNOWN: {gone}"
    assert sum(Counter(KNOWN).values()) == sum(found.values())
