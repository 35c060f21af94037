"""The plan of the llama_cpp role's steps when hosts share a build key (golden).

Planned from nothing on the lab's three hosts: with their platforms unknown every host clones
and compiles (as before build keys were shared); on one platform node1 compiles once, portable,
for all three and serves it, node2 and node3 copy it instead of cloning and compiling, also
while the ref is not resolved yet (no git on the hosts: the build is known after apply); with
node3 on another CPU architecture node3 compiles its own. A golden change means hosts would
compile or copy differently: update with MESHDEPLOY_UPDATE_GOLDEN=1 and review.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import registry
from meshdeploy.core.context import HostContext, Steps
from meshdeploy.core.plan import Plan
from meshdeploy.views.plan import render_text
from meshdeploy.roles.llama_cpp import settings

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "plan"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"


def platform(machine="x86_64", libc="glibc 2.36", cpu=None):
    return {"toolchain.Platform": {"kernel": "Linux", "machine": machine, "distro": "debian",
                                   "version": "12", "tools": ["cmake", "git"], "termux": False},
            "llama_cpp.Libc": libc, **({"llama_cpp.CpuFlags": cpu} if cpu else {})}


SCENARIOS = {
    "unknown-platforms": {h: platform(libc=None) for h in ("node1", "node2", "node3")},
    "one-platform": {h: platform() for h in ("node1", "node2", "node3")},
    "node3-aarch64": {"node1": platform(), "node2": platform(), "node3": platform("aarch64")},
    # Hosts with nothing installed: no git to resolve the ref at plan time.
    "one-platform-unresolved-ref": {h: platform() for h in ("node1", "node2", "node3")},
    # Without the lab file's GGML_NATIVE (OWN_CPU_CODE): every host reports the same CPU flags,
    # so the shared build stays -march=native.
    "one-cpu": {h: platform(cpu="6c1f0c4b2a9d8e7f") for h in ("node1", "node2", "node3")},
    # The same, one host's CPU differs: runtime CPU dispatch.
    "two-cpus": {"node1": platform(cpu="6c1f0c4b2a9d8e7f"), "node2": platform(cpu="6c1f0c4b2a9d8e7f"),
                 "node3": platform(cpu="0d2e4f6a8b1c3e5f")},
}


OWN_CPU_CODE = ("one-cpu", "two-cpus")  # the CPU code is meshdeploy's to choose, not the file's


def plan_text(name: str) -> str:
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    if name in OWN_CPU_CODE:
        cluster = settings.with_build(cluster, cmake_flags=())
    facts = {h.name: {**SCENARIOS[name][h.name],
                      "llama_cpp.Builds": {"current": None, "builds": {}}}
             for h in cluster.hosts}
    resolved = run_values(commit=None if name.endswith("-unresolved-ref") else COMMIT,
                        build_number=11312)
    steps, changes = Steps(), []
    for slot in registry.slots(cluster):
        if slot.resource.role != "llama_cpp":
            continue
        for h in cluster.hosts:
            ctx = HostContext(cluster, h, facts[h.name], resolved, steps, cluster_facts=facts)
            step = slot.resource.plan(ctx, slot.key)
            steps.add(h.name, slot.name, step)
            changes.append(step.change)
    hosts = [h.name for h in cluster.hosts]
    order = {h: i for i, h in enumerate(hosts)}
    changes.sort(key=lambda c: order[c.host])  # stable: apply order within each host
    plan = Plan(cluster_name="lab", cluster_path="inventories/lab.yaml", config_hash="c" * 64,
                fingerprints={h: f"{i:064x}" for i, h in enumerate(hosts)},
                changes=[c for c in changes if c.action != "no-op"], hosts=hosts)
    return render_text(plan)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_build_copy_plan_golden(name):
    text = plan_text(name)
    golden = GOLDEN / f"build-copy-{name}.txt"
    if os.environ.get("MESHDEPLOY_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with MESHDEPLOY_UPDATE_GOLDEN=1"
    assert text == golden.read_text()


def test_an_unresolved_ref_plans_the_same_hosts_copying():
    def steps(text):
        return [line for line in text.splitlines() if line.startswith("  # node")]

    assert steps(plan_text("one-platform-unresolved-ref")) == steps(plan_text("one-platform"))


def test_only_the_hosts_that_copy_plan_differently():
    before, after = plan_text("unknown-platforms"), plan_text("one-platform")
    assert before.count("/llama_cpp.source will") == 3
    assert after.count("/llama_cpp.source will") == 1
    assert "node2/llama_cpp.copy" in after and "node3/llama_cpp.copy" in after
    assert "node2/llama_cpp.build" not in after and "node1/llama_cpp.build" in after
