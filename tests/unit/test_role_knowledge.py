"""The layers beside the roles know them only through the registry: no module of core, engine,
execute, views or commands names a role, a resource or a fact key in its code. What a role
knows (its facts, the checks across hosts, the plan's network rows) is asked of it by a hook."""

from __future__ import annotations

import ast
from pathlib import Path

from support.accounts import load_inventory

from meshdeploy.core import registry

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "meshdeploy"
LAYERS = ("core", "engine", "execute", "views", "commands")
# Role names that are also words of other vocabularies: the plan's and the state's JSON fields
# ("network", "models") and a folder under llama_cpp.prefix ("models"). Such a literal names a
# field, not the role; a fact key or a resource address is never allowed.
WORDS = frozenset({"models", "network"})


def fact_keys() -> set[str]:
    """Every section key a role's facts hook asks for, on every host of every example file,
    planned and destroyed; "[key]" suffixes dropped."""
    keys = set()
    for path in sorted((ROOT / "inventories").glob("*.yaml")):
        cluster = load_inventory(path)
        for host in cluster.hosts:
            for first in (True, False):
                for destroying in (False, True):
                    request = registry.FactRequest(cluster, host, first, destroying)
                    keys |= {s.key.split("[")[0] for s in registry.sections(request)}
    return keys


def names() -> tuple[set[str], set[str]]:
    """(role names, role-qualified names: fact keys and resource addresses)."""
    roles = {r.name for r in registry.roles()}
    return roles, fact_keys() | {r.qualified for r in registry.resources()}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def named(text: str, roles: set[str], qualified: set[str]) -> bool:
    """Whether a string literal names a role, or is (or starts) a fact key or resource address
    ("llama_cpp.Builds", "services.Rtt[", "models.gguf")."""
    if text in roles - WORDS or text in qualified:
        return True
    head, dot, tail = text.partition(".")
    return bool(dot) and head in roles and any(
        text.startswith(q) or q.startswith(text) for q in qualified if q.startswith(head + "."))


def findings(folders=LAYERS) -> list[str]:
    roles, qualified = names()
    out = []
    for folder in folders:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            skip = _docstrings(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                        id(node) not in skip and named(node.value, roles, qualified):
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    return out


def test_the_names_are_known():
    roles, qualified = names()
    assert {"llama_cpp", "services"} <= roles
    assert {"llama_cpp.Builds", "services.Rtt", "models.gguf"} <= qualified


def test_the_scan_finds_a_fact_key_and_a_role_name():
    roles, qualified = names()
    assert named("llama_cpp.Builds", roles, qualified)
    assert named("services.Rtt", roles, qualified)
    assert named("rpc_cache", roles, qualified)
    assert named("llama_cpp.", roles, qualified)
    assert not named("models", roles, qualified)
    assert not named("llama_cpp.prefix must be an absolute path", roles, qualified)


def test_no_layer_beside_the_roles_names_a_role_or_a_fact():
    assert findings() == []
