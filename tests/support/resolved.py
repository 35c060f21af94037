"""A Resolved for a test, its roles' run values given by field name (commit=..., models=...,
splits=...): each goes into the run values of the role that fixes it."""

from __future__ import annotations

from dataclasses import fields

from meshdeploy.core.context import Resolved
from meshdeploy.roles.llama_cpp import run as llama_cpp_run
from meshdeploy.roles.models import run as models_run
from meshdeploy.roles.rpc_cache import run as rpc_cache_run

RUNS = (llama_cpp_run, models_run, rpc_cache_run)


def run_values(*, replace=(), **values) -> Resolved:
    owners = {f.name: module for module in RUNS for f in fields(module.Run)}
    unknown = sorted(set(values) - set(owners))
    if unknown:
        raise TypeError(f"no role fixes {unknown}")
    out = Resolved(replace=tuple(replace))
    for module in RUNS:
        mine = {k: v for k, v in values.items() if owners[k] is module}
        if mine:
            out = out.fixed(module.ROLE, module.Run(**mine))
    return out
