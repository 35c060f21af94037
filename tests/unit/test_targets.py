"""-target=ADDRESS (engine.targets): which resources a targeted run plans and applies, the
addresses it refuses, and a plan that says it is partial and destroys nothing."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import registry
from meshdeploy.core.plan import Plan
from meshdeploy.engine import planner as engine
from meshdeploy.engine import targets
from meshdeploy.errors import PlanError

LAB = Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml"
DEBIAN = {"kernel": "Linux", "machine": "x86_64", "distro": "debian", "version": "12",
          "tools": ["apt-get"], "termux": False}


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(LAB)


def test_a_resource_that_declares_its_needs_brings_only_those(cluster):
    got = targets.closure(cluster, cluster.hosts, ["network.allowlist"])
    assert got == {(h, s) for h in ("node1", "node2", "node3")
                   for s in ("network.allowlist", "toolchain.apt_proxy")}
    one = targets.closure(cluster, cluster.hosts, ["node2/toolchain.packages"])
    assert one == {("node2", "toolchain.packages"), ("node2", "toolchain.apt_proxy")}


def test_a_tunnel_brings_every_end_its_keys_and_allowlist_and_no_build(cluster):
    """network.wireguard reads its peers' public keys and needs their allow-lists to pass its
    UDP port: those on every host, and every host's end of the tunnel (one end alone, say with
    a new key from -replace, would name a key its peers do not know); llama.cpp's steps, which
    come earlier, stay out."""
    got = targets.closure(cluster, cluster.hosts, ["node1/network.wireguard"])
    needs = ("toolchain.apt_proxy", "network.allowlist", "network.wireguard_key",
             "network.wireguard")
    assert got == {(h, s) for h in ("node1", "node2", "node3") for s in needs}
    assert not any(s.startswith("llama_cpp.") for _, s in got)


def test_a_resource_without_declared_needs_brings_it_and_all_before_it_on_every_host(cluster):
    """A copier's step uses the same step on its source (models.gguf[M] fetches from the host
    whose models.gguf[M] serves M; llama_cpp.copy from its builder's): that comes too."""
    slots = [s.name for s in registry.slots(cluster, apply=True)]
    got = targets.closure(cluster, cluster.hosts, ["node2/models.gguf[gemma]"])
    upto = slots[:slots.index("models.gguf[gemma]") + 1]
    assert got == {(h.name, s) for s in upto for h in cluster.hosts}
    assert ("node1", "models.gguf[gemma]") in got


def test_an_address_for_a_host_the_limit_leaves_out_is_refused(cluster):
    with pytest.raises(PlanError, match=re.escape("-target=node3/network.allowlist: no such")):
        targets.check(cluster, ["node3/network.allowlist"], cluster.hosts[:2])


def test_a_keyed_slot_or_its_resource_can_be_named(cluster):
    slots = registry.slots(cluster, apply=True)
    keyed = next(s for s in slots if s.key is not None and s.resource.qualified == "models.gguf")
    by_slot = targets.closure(cluster, cluster.hosts, [f"node1/{keyed.name}"])
    by_resource = targets.closure(cluster, cluster.hosts, ["node1/models.gguf"])
    assert ("node1", keyed.name) in by_slot and by_slot <= by_resource


def test_no_address_is_everything(cluster):
    assert targets.closure(cluster, cluster.hosts, ()) is None


@pytest.mark.parametrize("address", ["network.allowlst", "node9/network.allowlist",
                                     "node2/models.gguf[nothing]", "network"])
def test_an_address_that_names_nothing_is_one_error(cluster, address):
    said = re.escape(f"-target={address}: no such resource address")
    with pytest.raises(PlanError, match=said) as e:
        targets.check(cluster, [address])
    assert "-target=network.allowlist" in e.value.hint


def test_every_declared_need_is_a_resource_that_comes_earlier():
    order = [r.qualified for r in registry.resources()]
    for r in registry.resources():
        for need in r.needs or ():
            assert need in order[:order.index(r.qualified)], (r.qualified, need)


@pytest.fixture
def planner(monkeypatch, tmp_path):
    """engine.make_plan with the toolchain and network roles only and the probe replaced by
    the facts given: hosts without nftables, apt-get and no proxy."""
    (tmp_path / "lab.yaml").write_text(LAB.read_text())
    cluster = load_cluster(tmp_path / "lab.yaml")
    roles = tuple(registry.role(name) for name in ("toolchain", "network"))
    monkeypatch.setattr(registry, "roles", lambda: roles)

    def make(targeted=(), departed=()):
        facts = {h.name: {"toolchain.Platform": DEBIAN, "toolchain.DebPackages": {},
                          "network.Tools": []} for h in cluster.hosts}
        monkeypatch.setattr(engine, "gather", lambda session, hosts, destroying=(): facts)
        session = SimpleNamespace(cluster=cluster, hosts=lambda: list(cluster.hosts),
                                  departed=list(departed), limit=None, warnings=lambda: [],
                                  read_remote=None)
        return engine.make_plan(session, targets=targeted)

    return make


def test_a_targeted_plan_holds_those_changes_only_and_says_it_is_partial(planner):
    whole = planner()
    part = planner(["node2/network.allowlist"])
    assert {c.address for c in part.plan.changes} == {
        "node2/network.allowlist", "node2/toolchain.apt_proxy"}
    assert len(whole.plan.changes) > len(part.plan.changes)
    (said,) = [w for w in part.plan.warnings if w.startswith("-target=")]
    assert said.startswith(f"-target=node2/network.allowlist: 2 of {len(whole.plan.changes)} ")
    assert part.plan.target == ["node2/network.allowlist"]
    again = Plan.from_dict(part.plan.to_dict())
    assert again.target == ["node2/network.allowlist"]  # apply PLANFILE keeps it
    assert not any(w.startswith("-target=") for w in whole.plan.warnings)


def test_a_targeted_run_destroys_no_departed_host(planner):
    part = planner(["network.allowlist"])
    assert part.teardown == {} and part.destroyed_hosts(["gone"]) == set()


def test_apply_runs_no_step_outside_the_target(planner):
    """apply evaluates every slot again inside its pyinfra operation: one outside the target
    answers no-op there, before anything is read or run on the host; a targeted one plans."""
    from meshdeploy.execute.apply import Run

    planned = planner(["node2/network.allowlist"])
    cluster = load_cluster(LAB)
    session = SimpleNamespace(cluster=cluster, hosts=lambda: list(cluster.hosts), departed=[],
                              state=SimpleNamespace(failed_hosts=()))
    run = Run(session, planned, progress=None)
    allowlist = registry.resource("network.allowlist")
    left_out = run.step("node1", allowlist, None)
    assert left_out.noop and left_out.change.reason == "not targeted (-target)"
    targeted = run.step("node2", allowlist, None)
    assert targeted.change.action == "create" and targeted.commands


def test_a_saved_plan_takes_its_own_limit_again():
    """--limit naming the plan's own hosts (in any order) is what the plan was made with."""
    from meshdeploy.commands import apply

    saved = Plan.from_dict({**Plan(cluster_name="lab", cluster_path="lab.yaml", config_hash="",
                                   fingerprints={}, changes=[], limit=["node2", "node1"]
                                   ).to_dict()})
    args = SimpleNamespace(file="lab.plan", target=None, replace=None, purge=False,
                           limit=["node1", "node2"])
    apply._refuse_new_addresses(args, saved)  # no error
    with pytest.raises(PlanError, match="--limit node1 given with a saved plan"):
        apply._refuse_new_addresses(SimpleNamespace(**{**vars(args), "limit": ["node1"]}), saved)


@pytest.mark.parametrize("extra", [["-target=network.allowlist"], ["--purge"], ["--limit", "node1"],
                                   ["-replace=node1/network.wireguard"]])
def test_a_saved_plan_refuses_addresses_it_was_not_made_with(planner, tmp_path, capsys, extra):
    """apply PLANFILE applies what that plan showed: an address or a --limit given beside it
    would change that, and is one error before anything is locked or probed."""
    from meshdeploy import cli, errors
    from meshdeploy.core.plan import save_plan

    saved = tmp_path / "part.plan"
    save_plan(planner(["node2/network.allowlist"]).plan, saved)
    code = cli.main(["apply", str(saved), *extra])
    err = capsys.readouterr().err
    assert code == errors.ERROR, err
    said = extra[0] if len(extra) == 1 else " ".join(extra)
    assert f"apply {saved}: {said} given with a saved plan" in err, err
    assert "Traceback" not in err
