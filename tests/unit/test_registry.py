"""The registry is the only list of resources: a role that exists only in its own folder is
discovered, ordered, probed, planned, rendered and required to have fixtures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshdeploy.config.load import load_cluster
from meshdeploy.core import registry
from meshdeploy.core.context import Resolved
from meshdeploy.core.plan import Plan
from meshdeploy.engine import planner as engine
from meshdeploy.roles.models.hf import HfFile, HfResolved
from meshdeploy.views.plan import render_json, render_text

ROOT = Path(__file__).resolve().parents[2]

ROLE_SOURCE = '''
"""zz_demo: a message of the day on every host (a test role)."""

from pyinfra.api import FactBase

from meshdeploy.core import shell
from meshdeploy.core.context import Step
from meshdeploy.core.probe import Section
from meshdeploy.core.registry import Resource, Role


class Motd(FactBase):
    def command(self):
        return shell.command("cat", "/etc/motd")

    def process(self, output):
        return "\\n".join(output)


def motd(ctx, key):
    want = f"{ctx.cluster.name}: {ctx.host.name}"
    if ctx.fact("zz_demo.Motd") == want:
        return Step(ctx.change("zz_demo", "motd", "no-op", "motd set"))
    return Step(ctx.change("zz_demo", "motd", "update", "motd differs"),
                [shell.write_file("/etc/motd", want + "\\n", "0644")])


ROLE = Role(name="zz_demo", doc=__doc__, facts=lambda req: [Section("zz_demo.Motd", Motd)],
            after=("toolchain",), before=("llama_cpp",),
            resources=(Resource("motd", motd, "a message of the day"),))
'''


@pytest.fixture
def demo_role(tmp_path, monkeypatch):
    import meshdeploy.roles as package

    (tmp_path / "zz_demo").mkdir()
    (tmp_path / "zz_demo" / "__init__.py").write_text(ROLE_SOURCE)
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    registry.roles.cache_clear()
    yield
    registry.roles.cache_clear()
    sys.modules.pop("meshdeploy.roles.zz_demo", None)


def test_roles_are_found_in_dependency_order():
    order = [r.name for r in registry.roles()]
    for role in registry.roles():
        assert all(order.index(other) < order.index(role.name) for other in role.after)
        assert all(order.index(other) > order.index(role.name) for other in role.before)
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    names = [s.name for s in registry.slots(cluster)]
    # The day-one sequence keeps its order whatever roles join it.
    day_one = ["toolchain.apt_proxy", "toolchain.packages", "llama_cpp.source", "llama_cpp.build",
               "models.gguf[gemma]", "rpc_cache.seed_tool", "rpc_cache.seed[50052]",
               "services.cleanup", "services.rpc_server[50052]", "services.llama_server[main]"]
    assert [n for n in names if n in day_one] == day_one
    assert names.index("network.allowlist") < names.index("services.rpc_server[50052]")
    apply_only = [s.name for s in registry.slots(cluster, apply=True)
                  if s.resource.apply_only]
    assert apply_only == ["llama_cpp.resolve"]


def test_a_role_in_its_own_folder_is_probed_planned_and_rendered(demo_role):
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    names = [s.name for s in registry.slots(cluster)]
    # after toolchain, before llama_cpp, by its own declaration alone
    assert names.index("toolchain.packages") < names.index("zz_demo.motd") \
        < names.index("llama_cpp.source")
    host = cluster.host("node2")
    sections, script = engine.probe_command(cluster, host, False, "n0nce")
    assert "zz_demo.Motd" in [s.key for s in sections] and "/etc/motd" in script

    facts = {h.name: {"toolchain.Platform": {"kernel": "Linux", "tools": ["apt-get"]},
                      "zz_demo.Motd": "lab: node1" if h.name == "node1" else None}
             for h in cluster.hosts}
    gemma = cluster.models["gemma"].source
    resolved = Resolved(commit="f" * 40, models={"gemma": HfResolved(
        gemma.repo, "c" * 40, (HfFile(gemma.files[0], 1, "a" * 64, "u"),))})
    steps = engine.evaluate(cluster, cluster.hosts, facts, resolved)
    assert steps.on("node1")["zz_demo.motd"].noop
    step = steps.on("node2")["zz_demo.motd"]
    assert step.change.action == "update" and "/etc/motd" in step.commands[0]

    changes = [steps.on(h.name)[s.name].change for s in registry.slots(cluster)
               for h in cluster.hosts]
    plan = Plan(cluster_name="lab", cluster_path=str(cluster.path), config_hash="c" * 64,
                fingerprints={}, changes=changes, hosts=[h.name for h in cluster.hosts])
    assert "node2/zz_demo.motd" in render_text(plan, color=False)
    assert '"node2/zz_demo.motd"' in render_json(plan)

    # pyinfra sees a named operation; the fixture tests would demand fixtures for it.
    from meshdeploy.operations import zz_demo

    op = zz_demo.motd
    assert (op.__name__, op._inner.__module__) == ("motd", "meshdeploy.roles.zz_demo")
    from support.fixtures import operations
    assert "zz_demo.motd" in operations()


def test_a_cycle_between_roles_is_one_error():
    a = registry.Role("a", "", (), lambda r: [], after=("b",))
    b = registry.Role("b", "", (), lambda r: [], after=("a",))
    with pytest.raises(registry.RegistryError, match="circle: a, b"):
        registry._ordered({"a": a, "b": b})
