"""Data-driven tests of every role fact and resource function, as pyinfra tests its own.

tests/facts/<role>.<Fact>/<case>.json
    {"kwargs": {...}, "output": [lines], "expected": value,
     "command_contains": [...], "command_lacks": [...]}          (the last two optional)
    The fact's command(**kwargs) must be a string; its output goes through the same decode as a
    real probe (empty output = the fact's default) and must equal `expected`.

tests/operations/<role>.<op>/<case>.json
    {"cluster": "inventories/lab.yaml" or inline YAML, "host": "node2", "arg": model/port/server,
     "facts": {section key: decoded value}, "peer_facts": {host: {section key: value}},
     "resolved": {"commit", "build_number", "models", "restarted", "replace", "shared",
                  "seeds": {"host:port": [{"model_sha", "tensors": [[name, offset, size,
                  layer]], "model_path", "model", "source"}]}},
     "run": {"build_key", "build_changed"}, "expected": {...}}
    "run" and "restarted" are what earlier steps decided (ctx.steps): llama_cpp.build's outcome
    on this host, and the rpc-servers (re)started anywhere.
    expected: "error" (message start, with optional "hint_contains"), or any of "action",
    "noop" (reason of a no-op step), "reason", "commands" (exact), "commands_contain",
    "commands_lack", "command_count", "sudo", "deferred" (known after apply: no commands
    yet, not a no-op), "diffs", "unit_diff_contain", "run" (the build outcome this step
    decides), "restarted" (rpc-servers restarted, earlier steps and this one),
    "returns" (for preflight: null when the host passes).
    "<<build_key>>" anywhere in facts, run or expected stands for the build key of (cluster,
    host, resolved commit): it embeds a hash of the cmake flags, which fixtures should not pin.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

import pytest
from pyinfra.api import FactBase
from support.steps import decided

from meshdeploy.config.load import load_cluster
from meshdeploy.core import probe, registry
from meshdeploy.core.context import HostContext, Resolved, Step
from meshdeploy.errors import PlanError
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.models.hf import HfFile, HfResolved
from meshdeploy.roles.rpc_cache.operations import SeedModel
from meshdeploy.roles.rpc_cache.tensors import Tensor

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
FACT_DIR = TESTS / "facts"
OP_DIR = TESTS / "operations"
BUILD_KEY = "<<build_key>>"


def operations() -> dict:
    """Every resource of the registry, and each role's preflight, by "<role>.<name>". Apply-only
    resources act on what earlier operations did on live hosts: the lab covers them."""
    out = {r.qualified: (lambda ctx, arg, r=r: r.plan(ctx, arg))
           for r in registry.resources() if not r.apply_only}
    for role in registry.roles():
        if role.preflight is not None:
            out[f"{role.name}.preflight"] = lambda ctx, arg, role=role: role.preflight(ctx)
    return out


OPERATIONS = operations()


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


def cases(base: Path) -> list[Path]:
    return sorted(base.glob("*/*.json"))


def case_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def as_decoded(key: str, value):
    """JSON has no tuples; give back the shapes process() returns, so comparisons stay strict."""
    if value is None:
        return None
    if key.startswith("models.ModelFile") and value.get("verified") is not None:
        return {**value, "verified": tuple(value["verified"])}
    if key.startswith("models.OllamaManifest"):
        return {**value, "blobs": {k: tuple(v) for k, v in value["blobs"].items()}}
    if key.startswith("rpc_cache.CacheDir"):
        return {**value, "marker": [tuple(m) for m in value["marker"]]}
    if key == "toolchain.Platform" and value.get("cmake_version") is not None:
        return {**value, "cmake_version": tuple(value["cmake_version"])}
    return value


def substitute(value, table: dict[str, str]):
    if isinstance(value, str):
        for needle, replacement in table.items():
            value = value.replace(needle, replacement)
        return value
    if isinstance(value, list):
        return [substitute(v, table) for v in value]
    if isinstance(value, dict):
        return {substitute(k, table): substitute(v, table) for k, v in value.items()}
    return value


# -- facts -----------------------------------------------------------------------------------------

def test_every_fact_class_has_present_absent_and_odd_cases():
    classes = fact_classes()
    assert len(classes) >= 10, sorted(classes)
    for key in classes:
        folder = FACT_DIR / key
        names = sorted(p.stem for p in folder.glob("*.json"))
        assert len(names) >= 3, f"{folder}: want present/absent/odd cases, have {names}"
    strays = {p.parent.name for p in cases(FACT_DIR)} - set(classes)
    assert not strays, f"fixture folders for facts that do not exist: {strays}"


@pytest.mark.parametrize("path", cases(FACT_DIR), ids=case_id)
def test_fact(path):
    data = json.loads(path.read_text())
    assert set(data) <= {"kwargs", "output", "expected", "command_contains", "command_lacks",
                         "note"}, f"{path}: unknown keys"
    key = path.parent.name
    fact = fact_classes()[key]
    command = fact().command(**data.get("kwargs", {}))
    assert isinstance(command, str) and command.strip()
    for needle in data.get("command_contains", []):
        assert needle in command, f"{needle!r} not in {command!r}"
    for needle in data.get("command_lacks", []):
        assert needle not in command, f"{needle!r} in {command!r}"
    # The same route a live probe takes: section lines through decode().
    section = probe.Section(key, fact, data.get("kwargs", {}))
    decoded = probe.decode([section], {key: data["output"]})[key]
    assert decoded == as_decoded(key, data["expected"])


# -- operations ------------------------------------------------------------------------------------

def load_case(path: Path, tmp_path: Path):
    data = json.loads(path.read_text())
    known = {"cluster", "host", "arg", "facts", "peer_facts", "resolved", "run", "expected",
             "note"}
    assert set(data) <= known, f"{path}: unknown keys {set(data) - known}"
    spec = data["cluster"]
    if "\n" in spec:
        cluster_file = tmp_path / "cluster.yaml"
        cluster_file.write_text(spec)
    else:
        cluster_file = ROOT / spec
    cluster = load_cluster(cluster_file)
    host = cluster.host(data["host"])
    r = data.get("resolved", {})
    resolved = Resolved(
        commit=r.get("commit"), build_number=r.get("build_number"), hf_token=r.get("hf_token"),
        replace=tuple(r.get("replace", ())),
        models={name: HfResolved(m["repo"], m["commit"], tuple(HfFile(**f) for f in m["files"]),
                                 m.get("auth"))
                for name, m in r.get("models", {}).items()},
        shared={name: tuple(tuple(t) for t in ts) for name, ts in r.get("shared", {}).items()},
        seeds={ref: tuple(SeedModel(m.get("model_path", ""), m["model_sha"],
                                    tuple(Tensor(*t) for t in m["tensors"]), m.get("model", ""),
                                    m.get("source"))
                          for m in models)
               for ref, models in r.get("seeds", {}).items()})
    table = {}
    if resolved.commit:
        table[BUILD_KEY] = llama_cpp.build_key(cluster, host, resolved.commit)
    facts = {k: as_decoded(k, v) for k, v in substitute(data.get("facts", {}), table).items()}
    run = substitute(data.get("run", {}), table)
    assert set(run) <= {"build_key", "build_changed", "failed_hosts"}, \
        f"{path}: unknown run keys {set(run)}"
    # Other hosts' facts, for cluster-wide resources (network.wireguard reads peers' keys).
    peers = {name: {k: as_decoded(k, v) for k, v in f.items()}
             for name, f in data.get("peer_facts", {}).items()}
    ctx = decided(HostContext(cluster, host, facts, resolved,
                              cluster_facts={**peers, host.name: facts},
                              failed_hosts=frozenset(run.get("failed_hosts", []))),
                  build_key=run.get("build_key"),
                  build_changed=bool(run.get("build_changed")),
                  restarted=r.get("restarted", []))
    return ctx, data.get("arg"), substitute(data["expected"], table)


def test_every_operation_has_fixtures():
    present = {p.parent.name for p in cases(OP_DIR)}
    assert set(OPERATIONS) <= present, f"no fixtures for {set(OPERATIONS) - present}"
    assert present <= set(OPERATIONS), f"fixtures for unknown operations {present - set(OPERATIONS)}"
    # Every resource the engine schedules is covered by some fixture folder.
    for inventory in sorted((ROOT / "inventories").glob("*.yaml")):
        for slot in registry.slots(load_cluster(inventory)):
            assert slot.resource.qualified in OPERATIONS, slot.name


@pytest.mark.parametrize("path", cases(OP_DIR), ids=case_id)
def test_operation(path, tmp_path):
    ctx, arg, expected = load_case(path, tmp_path)
    fn = OPERATIONS[path.parent.name]
    if "error" in expected:
        with pytest.raises(PlanError) as info:
            fn(ctx, arg)
        assert str(info.value).startswith(expected["error"]), str(info.value)
        if "hint_contains" in expected:
            assert expected["hint_contains"] in (info.value.hint or ""), info.value.hint
        return
    result = fn(ctx, arg)
    if "returns" in expected:
        assert result == expected["returns"]
        return
    assert isinstance(result, Step)
    check_step(result, ctx, expected)


def check_step(step: Step, ctx: HostContext, expected: dict) -> None:
    change = step.change
    joined = "\n".join(step.commands)
    assert change.host == ctx.host.name
    if "noop" in expected:
        assert step.noop, f"expected a no-op, got {change.action}: {step.commands}"
        assert change.reason == expected["noop"]
    if "action" in expected:
        assert change.action == expected["action"], change.reason
    if "reason" in expected:
        assert change.reason == expected["reason"]
    if "commands" in expected:
        assert step.commands == expected["commands"]
    for needle in expected.get("commands_contain", []):
        assert needle in joined, f"{needle!r} not in the commands:\n{joined}"
    for needle in expected.get("commands_lack", []):
        assert needle not in joined, f"{needle!r} in the commands:\n{joined}"
    if "command_count" in expected:
        assert len(step.commands) == expected["command_count"], step.commands
    if "sudo" in expected:
        assert step.sudo is expected["sudo"]
    if expected.get("deferred"):  # known after apply: nothing to run yet, yet not a no-op
        assert not step.commands and change.action != "no-op", (change.action, step.commands)
    if "diffs" in expected:
        got = [{k: getattr(d, k) for k in want} for d, want in zip(change.diffs, expected["diffs"])]
        assert len(change.diffs) == len(expected["diffs"]), change.diffs
        assert got == expected["diffs"]
    for needle in expected.get("unit_diff_contain", []):
        assert needle in (change.unit_diff or ""), change.unit_diff
    decided_now = {"build_key": step.build.key if step.build else None,
                   "build_changed": (step.build.changed or None) if step.build else None}
    for key, value in expected.get("run", {}).items():
        assert decided_now[key] == value, f"{key} = {decided_now[key]!r}"
    if "restarted" in expected:
        assert sorted(ctx.steps.restarted() | set(step.restarts)) == sorted(expected["restarted"])
