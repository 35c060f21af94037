"""What the fixture tests cover: the data cases' folders, every resource (and preflight) of the
registry, every fact class of the roles (tests/fixture/test_fixtures.py; the registry's own
test checks a temporary role shows up here)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from pyinfra.api import FactBase

from meshdeploy.core import registry

FIXTURES = Path(__file__).resolve().parents[1] / "fixture"
FACT_DIR = FIXTURES / "facts"
OP_DIR = FIXTURES / "operations"


def operations() -> dict:
    """Every resource of the registry, and each role's preflight, by "<role>.<name>". Apply-only
    resources act on what earlier operations did on live hosts: the lab covers them."""
    out = {r.qualified: (lambda ctx, arg, r=r: r.plan(ctx, arg))
           for r in registry.resources() if not r.apply_only}
    for role in registry.roles():
        if role.preflight is not None:
            out[f"{role.name}.preflight"] = lambda ctx, arg, role=role: role.preflight(ctx)
    return out


def fact_classes() -> dict[str, type[FactBase]]:
    """Every FactBase subclass defined in roles/*/facts.py, by "<role>.<Class>"."""
    found = {}
    for role in (r.name for r in registry.roles()):
        module = importlib.import_module(f"meshdeploy.roles.{role}.facts")
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, FactBase) and obj is not FactBase \
                    and obj.__module__ == module.__name__:
                found[f"{role}.{name}"] = obj
    return found
