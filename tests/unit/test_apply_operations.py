"""How apply turns the registry's slots into pyinfra operations: one per instance, a
`together` resource's instances in one (each host runs its own while the others run theirs),
models whose hosts do not meet in one, and a failure inside such an operation named by its
instance."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import registry
from meshdeploy.core.plan import Plan
from meshdeploy.engine.planner import Planned
from meshdeploy.execute import apply as applying

ROOT = Path(__file__).resolve().parents[2]


def multi_server(tmp_path) -> Path:
    """The lab's file with a second model and server, on node2."""
    text = (ROOT / "inventories" / "lab.yaml").read_text()
    text = text.replace("\nservers:\n", "\nservers:\n  second:\n    host: node2\n    model: other\n"
                        "    port: 8081\n    rpc: none\n", 1)
    text = text.replace("\nmodels:\n", "\nmodels:\n  other:\n    huggingface:\n"
                        "      repo: hugginllam/other-GGUF\n      file: other.gguf\n", 1)
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    return path


def test_servers_are_one_operation_of_all_their_keys_and_models_whose_hosts_differ_too(tmp_path):
    cluster = load_cluster(multi_server(tmp_path))
    ops = applying._operations(cluster)
    slots = registry.slots(cluster, apply=True)
    names = [name for name, _, _, _ in ops]
    assert len(names) == len(set(names))
    merged = {name: keys for name, _, _, keys in ops if keys is not None}
    assert set(merged) == {"services.llama_server", "services.rpc_server", "models.gguf"}
    assert set(merged["services.llama_server"]) == {"main", "second"}
    # gemma's hosts (node1) and other's (node2) do not meet: both download at once.
    assert merged["models.gguf"] == ("other", "gemma")
    assert "llama_cpp.build" in names
    # Every slot is in exactly one operation, in slot order.
    covered = [(r.qualified, k) for _, r, key, keys in ops
               for k in (keys if keys is not None else (key,))]
    assert covered == [(s.resource.qualified, s.key) for s in slots]


def test_models_whose_hosts_meet_are_operations_in_turn(tmp_path):
    """A host holding two models runs each model's instance with that model's other hosts (a
    copier of M must run models.gguf[M] while M's source does): one operation per model."""
    path = multi_server(tmp_path)
    path.write_text(path.read_text().replace("    host: node2\n    model: other\n",
                                             "    host: node1\n    model: other\n"))
    cluster = load_cluster(path)
    models = [keys for name, _, _, keys in applying._operations(cluster)
              if name == "models.gguf"]
    assert models == [("other",), ("gemma",)]  # the file's order


def run_of(cluster):
    session = SimpleNamespace(cluster=cluster, hosts=lambda: list(cluster.hosts), departed=(),
                              state=SimpleNamespace(failed_hosts=()))
    planned = Planned(Plan("lab", "lab.yaml", "c" * 64, {}, [], []), None,
                      {h.name: {} for h in cluster.hosts}, None)
    said = []
    return applying.Run(session, planned, said.append), said


def test_each_instance_of_a_keyed_operation_gets_its_own_summary_row(tmp_path):
    run, said = run_of(load_cluster(multi_server(tmp_path)))
    run.begin("node1", "models.gguf[gemma]")
    run.finish("node1", "models.gguf[gemma]", "ok")
    run.begin("node1", "models.gguf[other]")
    run.finish("node1", "models.gguf[other]", "ok")
    run.finish("node2", "models.gguf[gemma]", "ok")  # never began there: a no-op, no row
    assert [(r["host"], r["step"], r["status"]) for r in run.results] == [
        ("node1", "models.gguf[gemma]", "ok"), ("node1", "models.gguf[other]", "ok")]
    assert len(said) == 2 and "models.gguf[other]" in said[1]


class Meta:
    def __init__(self, names):
        self.names = names


def test_a_failure_in_a_keyed_operation_names_the_instance_that_failed(tmp_path):
    run, _ = run_of(load_cluster(multi_server(tmp_path)))
    state = SimpleNamespace(get_op_meta=lambda op_hash: Meta({"models.gguf"}))
    host = SimpleNamespace(name="node1")
    run.begin("node1", "models.gguf[gemma]")
    run.finish("node1", "models.gguf[gemma]", "ok")
    run.begin("node1", "models.gguf[other]")
    applying._record(run, state, host, "h", "failed")
    assert run.results[-1]["step"] == "models.gguf[other]"
    assert run.failed_as[("node1", "models.gguf")] == "models.gguf[other]"
    # A plan that raised before its instance began is named by the run's failure.
    run.failure = {"host": "node2", "step": "models.gguf[other]", "error": ValueError()}
    applying._record(run, state, SimpleNamespace(name="node2"), "h", "failed")
    assert run.results[-1]["step"] == "models.gguf[other]"
    # A whole operation that ended well on a host without instances leaves no row.
    before = len(run.results)
    applying._record(run, state, SimpleNamespace(name="node3"), "h", "ok")
    assert len(run.results) == before


def test_hosts_run_their_own_instances_of_a_keyed_resource_at_once(tmp_path, monkeypatch):
    """Real pyinfra operations over three hosts (its @local connector): each host's instance
    of a keyed resource waits until every host's instance has begun. One operation per
    instance (key a everywhere, then b, then c) never gets there: node1's `a` gives up after
    10 s and the apply fails; one operation for all keys lets the three meet."""
    from pyinfra.api import Config, Inventory, State

    from meshdeploy.core.context import Step
    from meshdeploy.core.plan import Change
    from meshdeploy.remote.session import use_local_connectors

    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    mine = {"node1": "a", "node2": "b", "node3": "c"}
    meet = (f"touch {tmp_path}/begun-$K; i=0; while [ $i -lt 100 ]; do "
            f"[ -e {tmp_path}/begun-a ] && [ -e {tmp_path}/begun-b ] && "
            f"[ -e {tmp_path}/begun-c ] && exit 0; sleep 0.1; i=$((i+1)); done; exit 1")

    def plan(ctx, key):
        change = Change(ctx.host.name, "test", f"meet[{key}]",
                        "create" if mine[ctx.host.name] == key else "no-op")
        return Step(change, [f"K={key}; {meet}"] if change.action == "create" else [],
                    sudo=False)

    resource = registry.Resource("meet", plan, "three hosts meet", keys=lambda c: "abc",
                                 role="test", together=True)
    monkeypatch.setattr(registry, "slots", lambda c, apply=False: [
        registry.Slot(resource.slot(k), resource, k) for k in "abc"])
    monkeypatch.setattr(registry, "roles", lambda: ())
    inventory = Inventory(([(h.name, {}) for h in cluster.hosts], {}))
    use_local_connectors(inventory, [h.name for h in cluster.hosts])
    state = State(inventory, Config(), check_for_changes=False)
    for host in inventory:
        host.connect(raise_exceptions=True)
        state.activate_host(host)
    session = SimpleNamespace(cluster=cluster, hosts=lambda: list(cluster.hosts), departed=(),
                              state=state, reached=lambda: list(cluster.hosts),
                              connection_lost=lambda name: False)
    planned = Planned(Plan("lab", "lab.yaml", "c" * 64, {}, [], []), None,
                      {h.name: {} for h in cluster.hosts}, None)
    rows = applying.apply(session, planned, progress=None)
    assert sorted((r["host"], r["step"], r["status"]) for r in rows) == [
        ("node1", "test.meet[a]", "ok"), ("node2", "test.meet[b]", "ok"),
        ("node3", "test.meet[c]", "ok")]
