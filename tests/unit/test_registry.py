"""The registry is the only list of resources: a role that exists only in its own folder is
discovered, ordered, probed, planned, rendered and required to have fixtures; its schema.json
adds its own section to the cluster file, read as the role's typed settings, and its status hook
its own lines to `meshdeploy status`."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from support.resolved import run_values

from meshdeploy.commands import status as status_command
from meshdeploy.config import schema
from meshdeploy.core.loading import load_cluster
from meshdeploy.core import registry
from meshdeploy.core.plan import Plan
from meshdeploy.errors import ConfigError, MeshdeployError
from meshdeploy.engine import planner as engine
from meshdeploy.roles.models.hf import HfFile, HfResolved
from meshdeploy.views import status as status_view
from meshdeploy.views.plan import render_json, render_text

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "inventories" / "lab.yaml"

ROLE_SOURCE = '''
"""zz_demo: a message of the day on every host (a test role)."""

from dataclasses import dataclass

from pyinfra.api import FactBase

from meshdeploy.core import shell
from meshdeploy.core.context import Step
from meshdeploy.core.probe import Section
from meshdeploy.core.registry import Resource, Role, StatusProbe, StatusRow


@dataclass(frozen=True)
class Settings:
    """The cluster file's `zz_demo:` section (schema.json), typed."""

    path: str
    prefix: str


class Motd(FactBase):
    def command(self, path):
        return shell.command("cat", path)

    def process(self, output):
        return "\\n".join(output)


def facts(req):
    settings = Settings(**req.cluster.sections["zz_demo"])
    return [Section("zz_demo.Motd", Motd, {"path": settings.path})]


def motd(ctx, key):
    settings = Settings(**ctx.section("zz_demo"))
    want = f"{settings.prefix}{ctx.cluster.name}: {ctx.host.name}"
    if ctx.fact("zz_demo.Motd") == want:
        return Step(ctx.change("zz_demo", "motd", "no-op", "motd set"))
    return Step(ctx.change("zz_demo", "motd", "update", "motd differs"),
                [shell.write_file(settings.path, want + "\\n", "0644")])


def status(cluster, host):
    path = Settings(**cluster.sections["zz_demo"]).path

    def parse(lines):
        found = lines == ["set"]
        return [StatusRow("motd", "-", f"{'set' if found else 'missing'}: {path}", found)]

    return StatusProbe(shell.script('if [ -s "$1" ]; then echo set; else echo missing; fi',
                                    args=[path]), parse)


ROLE = Role(name="zz_demo", doc=__doc__, facts=facts, status=status,
            after=("toolchain",), before=("llama_cpp",),
            resources=(Resource("motd", motd, "a message of the day"),))
'''

SCHEMA = {"type": "object", "additionalProperties": False, "default": {},
          "properties": {"path": {"type": "string", "pattern": "^/", "default": "/etc/motd"},
                         "prefix": {"type": "string", "default": ""}}}


def clear_caches():
    registry.roles.cache_clear()
    registry.file_hooks.cache_clear()
    for cached in (schema.load_schema, schema.schema_validator, schema.role_fragments):
        cached.cache_clear()


def tree(folder: Path) -> dict:
    """Every file under `folder` (bytecode caches aside) -> its size and modification time."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture
def demo_role(tmp_path, monkeypatch):
    """The role zz_demo in a temporary folder only: its module and its schema.json."""
    import meshdeploy.roles as package

    before = {**tree(ROOT / "meshdeploy"), **tree(ROOT / "inventories"),
              ROOT / "pyproject.toml": (ROOT / "pyproject.toml").stat().st_mtime_ns}
    folder = tmp_path / "roles" / "zz_demo"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("")
    (folder / "role.py").write_text(ROLE_SOURCE)
    (folder / "schema.json").write_text(json.dumps(SCHEMA, indent=2))
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path / "roles")])
    clear_caches()
    yield
    clear_caches()
    for name in ("meshdeploy.roles.zz_demo", "meshdeploy.roles.zz_demo.role"):
        sys.modules.pop(name, None)
    after = {**tree(ROOT / "meshdeploy"), **tree(ROOT / "inventories"),
             ROOT / "pyproject.toml": (ROOT / "pyproject.toml").stat().st_mtime_ns}
    assert after == before, "the temporary role changed a file outside its folder"


def test_roles_are_found_in_dependency_order():
    order = [r.name for r in registry.roles()]
    for role in registry.roles():
        assert all(order.index(other) < order.index(role.name) for other in role.after)
        assert all(order.index(other) > order.index(role.name) for other in role.before)
    cluster = load_cluster(LAB)
    names = [s.name for s in registry.slots(cluster)]
    # The day-one sequence keeps its order whatever roles join it.
    # services.cleanup runs before any model byte moves (runs_before): a stale forward may hold
    # the loopback port of the one that carries them.
    day_one = ["toolchain.apt_proxy", "toolchain.packages", "llama_cpp.source", "llama_cpp.build",
               "services.cleanup", "models.gguf[gemma]", "rpc_cache.seed_tool",
               "rpc_cache.seed[50052]", "services.rpc_server[50052]",
               "services.llama_server[main]"]
    assert [n for n in names if n in day_one] == day_one
    assert names.index("network.allowlist") < names.index("services.rpc_server[50052]")
    apply_only = [s.name for s in registry.slots(cluster, apply=True)
                  if s.resource.apply_only]
    assert apply_only == ["llama_cpp.resolve"]


def demo_steps(cluster):
    """The lab's steps with node1's motd already "lab: node1" and node2's absent."""
    facts = {h.name: {"toolchain.Platform": {"kernel": "Linux", "tools": ["apt-get"]},
                      "zz_demo.Motd": "lab: node1" if h.name == "node1" else None}
             for h in cluster.hosts}
    gemma = cluster.models["gemma"].source
    resolved = run_values(commit="f" * 40, models={"gemma": HfResolved(
        gemma.repo, "c" * 40, (HfFile(gemma.files[0], 1, "a" * 64, "u"),))})
    return engine.evaluate(cluster, cluster.hosts, facts, resolved)


def demo_cluster(tmp_path: Path, section: str) -> Path:
    """The lab's cluster file with `section` added at its end."""
    path = tmp_path / "cluster.yaml"
    path.write_text(LAB.read_text() + section)
    return path


def test_a_role_in_its_own_folder_is_probed_planned_and_rendered(demo_role):
    cluster = load_cluster(LAB)
    names = [s.name for s in registry.slots(cluster)]
    # after toolchain, before llama_cpp, by its own declaration alone
    assert names.index("toolchain.packages") < names.index("zz_demo.motd") \
        < names.index("llama_cpp.source")
    host = cluster.host("node2")
    sections, script = engine.probe_command(cluster, host, False, "n0nce")
    assert "zz_demo.Motd" in [s.key for s in sections] and "/etc/motd" in script

    steps = demo_steps(cluster)
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


def test_a_role_declares_its_own_section_of_the_cluster_file(demo_role, tmp_path):
    base = json.loads((ROOT / "meshdeploy" / "schemas" / "core.schema.json").read_text())
    assert "zz_demo" not in base["properties"]  # the core holds no role's own section
    merged = schema.load_schema()
    assert merged["properties"]["zz_demo"] == SCHEMA
    jsonschema.Draft202012Validator.check_schema(merged)
    # Absent, the section reads as its defaults.
    assert load_cluster(LAB).sections["zz_demo"] == {"path": "/etc/motd", "prefix": ""}

    cluster = load_cluster(demo_cluster(tmp_path, "zz_demo: {path: /srv/motd, prefix: 'hi '}\n"))
    assert cluster.sections["zz_demo"] == {"path": "/srv/motd", "prefix": "hi "}
    _, script = engine.probe_command(cluster, cluster.host("node2"), False, "n0nce")
    assert "cat /srv/motd" in script and "/etc/motd" not in script
    steps = demo_steps(cluster)
    for host in ("node1", "node2"):  # node1 holds "lab: node1", without the prefix
        step = steps.on(host)["zz_demo.motd"]
        assert step.change.action == "update"
        assert "/srv/motd" in step.commands[0] and f"hi lab: {host}" in step.commands[0]


def test_a_bad_value_in_a_role_section_is_one_error_at_its_position(demo_role, tmp_path):
    path = demo_cluster(tmp_path, "zz_demo:\n  prefix: ok\n  path: motd\n")
    with pytest.raises(ConfigError) as caught:
        load_cluster(path)
    line = len(LAB.read_text().splitlines()) + 3
    assert [str(issue) for issue in caught.value.issues] == \
        [f"{path}:{line}:9: zz_demo.path: 'motd' does not match ^/"]


def test_a_role_adds_its_lines_to_status(demo_role, tmp_path):
    motd = tmp_path / "motd"
    motd.write_text("hello\n")
    cluster = load_cluster(demo_cluster(tmp_path, f"zz_demo: {{path: {motd}}}\n"))
    script = status_command.host_script(cluster, cluster.host("node2"), "n0nce")
    assert f"printf '\\n@role-%s %s\\n' n0nce zz_demo\n( set -- {motd}\n" in script
    bin_dir = tmp_path / "bin"  # no service answers: systemctl, curl and python3 say nothing
    bin_dir.mkdir()
    for name in ("curl", "systemctl", "python3"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)

    class Session:
        """Runs each host's status script here, as `sh -c`."""

        def hosts(self):
            return cluster.hosts

        def run(self, name, command, sudo=None):
            out = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                                 timeout=30, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
            return out.returncode == 0, SimpleNamespace(stdout_lines=out.stdout.splitlines())

    Session.cluster = cluster
    rows = status_command.collect(Session())
    mine = [{"host": h.name, "service": "motd", "unit": "-", "answer": f"set: {motd}",
             "protocol": None, "model": None, "healthy": True} for h in cluster.hosts]
    assert [r for r in rows if r["service"] == "motd"] == mine
    assert len(rows) > len(mine)  # the services' own rows as before
    lines = [line.split() for line in status_view.render_text(rows).splitlines()]
    assert all([h.name, "motd", "-", "set:", str(motd), "yes"] in lines for h in cluster.hosts)
    assert all(row in json.loads(status_view.render_json(rows)) for row in mine)

    motd.unlink()
    rows = [r for r in status_command.collect(Session()) if r["service"] == "motd"]
    assert {(r["answer"], r["healthy"]) for r in rows} == {(f"missing: {motd}", False)}


def test_a_hosts_output_cannot_move_lines_to_a_role(demo_role, tmp_path):
    """Only a mark with the run's nonce, naming the next role expected, starts a role's lines:
    a host that prints a mark of its own, or a line without its newline, moves nothing."""
    cluster = load_cluster(demo_cluster(tmp_path, ""))
    host = cluster.host("node2")
    lines = ["proto 7.0.0", "@role-guess zz_demo", "set", "@role- zz_demo", "set", "",
             "@role-n0nce zz_demo", "missing", "", "@role-n0nce zz_demo", "set"]
    own, rows = status_command.role_rows(cluster, host, lines, "n0nce")
    assert own == ["proto 7.0.0", "@role-guess zz_demo", "set", "@role- zz_demo", "set"]
    assert [(r["answer"].split(":")[0], r["healthy"]) for r in rows] == [("missing", False)]


def test_a_host_whose_output_cannot_be_read_is_a_row_not_a_lost_host(demo_role, tmp_path,
                                                                       monkeypatch):
    """Odd JSON from /v1/models leaves the model blank; a parse that fails (a role's, say)
    gives its host an unhealthy row instead of dropping the host from status."""
    cluster = load_cluster(demo_cluster(tmp_path, ""))

    class Session:
        def hosts(self):
            return cluster.hosts

        def run(self, name, command, sudo=None):
            return True, SimpleNamespace(stdout_lines=[
                "server main active 200", 'models main {"data": ["x", {"id": 2}]}'])

    Session.cluster = cluster
    rows = status_command.collect(Session())
    assert {(r["host"], r["model"], r["healthy"]) for r in rows
            if r["service"] == "llama-server main"} == {(h.name, None, True) for h in cluster.hosts}
    real = status_command.role_rows

    def role_rows(cluster, host, lines, nonce=""):
        if host.name == "node2":
            raise ValueError("a line no parse expected")
        return real(cluster, host, lines, nonce)

    monkeypatch.setattr(status_command, "role_rows", role_rows)
    rows = status_command.collect(Session())
    assert [(r["host"], r["answer"], r["healthy"]) for r in rows if r["host"] == "node2"] == [
        ("node2", "status output unreadable: ValueError: a line no parse expected", False)]
    assert {r["host"] for r in rows} == {h.name for h in cluster.hosts}


@pytest.mark.parametrize("name,fragment,message", [
    ("hosts", {"type": "object"},
     "roles/hosts/schema.json declares the section 'hosts', which the cluster file "
     "already has"),
    ("network", {"type": "object"},
     "roles/network/schema.json declares the section 'network', which "
     "roles/network/schema.json declares too"),
    ("zz_bad", {"type": "objekt"}, "roles/zz_bad/schema.json is not a JSON Schema"),
    ("zz_ref", {"$defs": {"p": {"type": "string"}}, "properties": {"p": {"$ref": "#/$defs/p"}}},
     "roles/zz_ref/schema.json uses $ref or $defs"),
])
def test_a_role_section_that_clashes_or_is_no_schema_is_refused(tmp_path, monkeypatch, name,
                                                                 fragment, message):
    (tmp_path / name).mkdir()
    (tmp_path / name / "schema.json").write_text(json.dumps(fragment))
    refused_with_roles_in(tmp_path, monkeypatch, message)


def refused_with_roles_in(folder, monkeypatch, message: str) -> None:
    """Loading the lab's file with the role folders under `folder` added fails with `message`."""
    import meshdeploy.roles as package

    monkeypatch.setattr(package, "__path__", [*package.__path__, str(folder)])
    clear_caches()
    try:
        with pytest.raises(MeshdeployError, match=re.escape(message)):
            load_cluster(LAB)
    finally:
        monkeypatch.undo()
        clear_caches()


@pytest.mark.parametrize("files,message", [
    ({"zz_one/schema.servers.json": {"type": "object"}},
     "roles/zz_one/schema.servers.json declares the section 'servers', which the cluster file "
     "already has"),
    ({"zz_one/schema.zz_x.json": {"type": "object"}, "zz_two/schema.zz_x.json": {"type": "object"}},
     "roles/zz_two/schema.zz_x.json declares the section 'zz_x', which "
     "roles/zz_one/schema.zz_x.json declares too"),
    ({"zz_one/schema.a.b.json": {"type": "object"}},
     "roles/zz_one/schema.a.b.json: a role's sections are schema.json and schema.<section>.json"),
])
def test_a_second_section_is_refused_where_it_clashes(tmp_path, monkeypatch, files, message):
    for name, fragment in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(json.dumps(fragment))
    refused_with_roles_in(tmp_path, monkeypatch, message)


def test_the_models_role_owns_the_huggingface_section():
    where, fragment = schema.role_fragments()["huggingface"]
    assert where == "roles/models/schema.huggingface.json"
    assert "huggingface" not in json.loads(
        (ROOT / "meshdeploy" / "schemas" / "core.schema.json").read_text())["properties"]
    assert fragment["properties"]["endpoint"]["default"] == "https://huggingface.co"


@pytest.mark.parametrize("section", ["llama_cpp", "network", "toolchain", "monitoring"])
def test_the_role_of_the_same_name_owns_the_section(section):
    where, fragment = schema.role_fragments()[section]
    assert where == f"roles/{section}/schema.json"
    assert section not in json.loads(
        (ROOT / "meshdeploy" / "schemas" / "core.schema.json").read_text())["properties"]
    assert section in schema.load_schema()["properties"]


def test_a_required_role_section_is_required_in_the_complete_schema():
    assert schema.role_fragments()["llama_cpp"][1][schema.REQUIRED] is True
    assert "llama_cpp" in schema.load_schema()["required"]
    assert "network" not in schema.load_schema()["required"]


def test_every_role_section_ships_in_the_package():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = data["package-data"]["*"]
    files = sorted(ROOT.glob("meshdeploy/roles/*/schema*.json"))
    assert len(files) >= 3  # monitoring, toolchain, models' huggingface
    for path in files:
        assert any(fnmatch.fnmatch(path.name, pattern) for pattern in shipped), path


def test_a_cycle_between_roles_is_one_error():
    a = registry.Role("a", "", (), lambda r: [], after=("b",))
    b = registry.Role("b", "", (), lambda r: [], after=("a",))
    with pytest.raises(registry.RegistryError, match="circle: a, b"):
        registry._ordered({"a": a, "b": b})


def test_the_schema_editors_read_is_the_core_with_every_roles_section():
    """schemas/cluster.schema.json is generated (scripts/schema): the core sections and each
    role's schema.json, so an editor knows every section a role adds (`monitoring:` too)."""
    committed = (ROOT / "meshdeploy" / "schemas" / "cluster.schema.json").read_text()
    assert committed == schema.complete_text(), \
        "schemas/cluster.schema.json is stale: run scripts/schema"
    complete = json.loads(committed)
    core = json.loads((ROOT / "meshdeploy" / "schemas" / "core.schema.json").read_text())
    assert schema.role_sections()
    for role in schema.role_sections():
        assert role in complete["properties"] and role not in core["properties"]


def test_a_roles_run_value_is_read_by_name_and_a_wrong_name_is_an_error():
    from support.resolved import run_values

    resolved = run_values(commit="c" * 40)
    assert resolved.value("llama_cpp", "commit") == "c" * 40
    assert resolved.value("rpc_cache", "splits", {}) == {}  # that role fixed nothing
    with pytest.raises(AttributeError):
        resolved.value("llama_cpp", "comit")
