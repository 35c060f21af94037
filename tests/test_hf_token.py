"""A Hugging Face token reaches hosts only as an uploaded file: never in commands or the plan."""

from __future__ import annotations

from pathlib import Path

from meshdeploy.deploy.config import load_cluster
from meshdeploy.deploy.context import HostContext, Resolved, Upload
from meshdeploy.deploy.model import HfFile, HfResolved
from meshdeploy.deploy.plan import Plan
from meshdeploy.deploy.render import render_json, render_text
from meshdeploy.roles.models import operations as models

LAB = Path(__file__).resolve().parent.parent / "inventories" / "lab.yaml"
TOKEN = "hf_SECRETsecretSECRET123"


def step_with(token):
    cluster = load_cluster(LAB)
    resolved = Resolved(commit="f" * 40, hf_token=token)
    resolved.models["gemma"] = HfResolved("org/repo", "c" * 40, (HfFile(
        "gemma-3-270m-q4_k_m.gguf", 1000, "a" * 64, "http://10.200.0.1:8080/org/repo/resolve/c/x"),))
    facts = {"models.DiskFree": 10**12}
    return models.gguf(HostContext(cluster, cluster.host("node1"), facts, resolved), "gemma")


def test_token_travels_as_an_upload_and_is_removed():
    step = step_with(TOKEN)
    uploads = [c for c in step.commands if isinstance(c, Upload)]
    assert len(uploads) == 1 and TOKEN in uploads[0].content
    shell = [c for c in step.commands if isinstance(c, str)]
    assert not any(TOKEN in c for c in shell)
    assert any(f"AUTH={uploads[0].path}\n" in c and '-H "@$AUTH"' in c for c in shell)
    assert shell[0].startswith("install -d -m 700 ") and shell[-1].startswith("rm -rf ")
    plan = Plan(cluster_name="lab", cluster_path=str(LAB), config_hash="x", fingerprints={},
                changes=[step.change], hosts=["node1"])
    assert TOKEN not in render_text(plan) and TOKEN not in render_json(plan)
    assert "(sensitive value)" in render_text(plan)


def test_no_token_no_upload():
    step = step_with(None)
    assert not any(isinstance(c, Upload) for c in step.commands)
    assert all("AUTH=''\n" in c for c in step.commands if "curl" in c)
