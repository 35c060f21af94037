"""rpc_cache wiring: which worker seeds which tensors from the placement.

The model behind inventories/two-cuda-11-16.yaml (gemma-3-27b Q4_K_M) cannot be fetched here;
model_headers.gemma27_header stands in for it (the seed scenario's split: an 11 GB card over
RPC, a 16 GB card local). The placement tables of every scenario are golden-tested in
test_placement_scenarios.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from support.model_headers import gemma27_header
from support.resolved import run_values

from meshdeploy.config import distribution
from meshdeploy.core.loading import load_cluster
from meshdeploy.config.sources import HfFile, HfResolved
from meshdeploy.errors import PlanError
from meshdeploy.placement.tensors import Header, weight_tensors
from meshdeploy.roles.models import operations as models
from meshdeploy.roles.rpc_cache import seeding

ROOT = Path(__file__).resolve().parents[2]
SHA = "ab" * 32
HUB = "https://huggingface.co"


def prepared(path: str, facts: dict, header: Header):
    cluster = load_cluster(ROOT / path)
    resolved = run_values(models={
        "gemma27": HfResolved("unsloth/gemma-3-27b-it-GGUF", "c" * 40,
                              (HfFile("gemma-3-27b-it-Q4_K_M.gguf", 16_546_688_000, SHA, "u"),), api=HUB)})
    fetched = []

    def fetch(url, size, token=None):
        fetched.append(url)
        p = Path(os.environ.get("PYTEST_TMP", "/tmp")) / f"hdr-{os.getpid()}"
        p.write_bytes(b"")
        return p

    import meshdeploy.roles.rpc_cache.seeding as mod
    original = mod.read_header
    mod.read_header = lambda _path: header
    try:
        planned = seeding.prepare(cluster, cluster.hosts, facts, resolved, fetch=fetch)
    finally:
        mod.read_header = original
    return cluster, planned, fetched


GPU_FACTS = {"box11": {"rpc_cache.DeviceMemory": {"cpu": None, "cuda": [
                 {"total": 11811160064, "free": 11500000000}]}},
             "box16": {"rpc_cache.DeviceMemory": {"cpu": None, "cuda": [
                 {"total": 17179869184, "free": 16800000000}]}}}


def test_only_the_cached_worker_seeds_its_own_layers():
    cluster, planned, _ = prepared("inventories/two-cuda-11-16.yaml", GPU_FACTS, gemma27_header())
    assert list(planned.seeds) == ["box11:50052"]
    (seed,) = planned.seeds["box11:50052"]
    assert seed.model_sha == SHA
    # box11 loads no llama-server of gemma27: it fetches its tensors from box16's copy.
    assert (seed.model_path, seed.model, seed.source) == ("", "gemma27", "box16")
    rpc_row = planned.layouts[0].rows[0]
    # -ts 11,16 over 62 layers + output: llama.cpp gives the RPC card layers 0..25.
    assert rpc_row["layers"] == "0-25"
    assert {t.layer for t in seed.tensors} == set(range(26))
    assert sum(t.size for t in seed.tensors if t.hashed) == rpc_row["seed"] > 0
    # Only the orchestrator keeps the GGUF (one download); the worker keeps its tensors.
    assert models.needed(cluster, cluster.host("box11")) == []
    assert models.needed(cluster, cluster.host("box16")) == ["gemma27"]
    # The digest list covers every hashed tensor, whichever worker holds it.
    assert planned.shared["gemma27"] == tuple(sorted(
        (t.offset, t.size) for t in weight_tensors(gemma27_header()) if t.hashed))


def test_auto_split_without_memory_facts_is_refused(tmp_path):
    text = (ROOT / "inventories/two-cuda-11-16.yaml").read_text()
    path = tmp_path / "auto.yaml"
    path.write_text(text.replace("tensor_split: [11, 16]", "tensor_split: auto"))
    cluster = load_cluster(path)
    resolved = run_values(models={"gemma27": HfResolved("r", "c" * 40, (HfFile("f", 1, SHA, "u"),),
                                                        api=HUB)})
    import meshdeploy.roles.rpc_cache.seeding as mod
    original = mod.read_header
    mod.read_header = lambda _path: gemma27_header()
    try:
        with pytest.raises(PlanError, match="the free memory of box11:50052/CUDA0, box16/CUDA0 is unknown"):
            planned = seeding.prepare(cluster, cluster.hosts, {}, resolved,
                            fetch=lambda *a, **k: tmp_path.joinpath("h").touch() or
                            tmp_path / "h")
    finally:
        mod.read_header = original


def test_header_cache_spares_the_next_plan_a_fetch(tmp_path):
    cluster = load_cluster(ROOT / "inventories/two-cuda-11-16.yaml")
    fetched = []

    def fetch(url, size, token=None, dest=None):
        fetched.append(url)
        dest.write_bytes(b"")
        return dest

    import meshdeploy.roles.rpc_cache.seeding as mod
    original = mod.read_header
    mod.read_header = lambda _path: gemma27_header()
    try:
        for _ in range(2):
            resolved = run_values(models={"gemma27": HfResolved(
                "unsloth/gemma-3-27b-it-GGUF", "c" * 40,
                (HfFile("gemma-3-27b-it-Q4_K_M.gguf", 16_546_688_000, SHA, "u"),), api=HUB)})
            planned = seeding.prepare(cluster, cluster.hosts, GPU_FACTS, resolved,
                            fetch=fetch, header_cache=tmp_path)
            assert planned.layouts
    finally:
        mod.read_header = original
    assert len(fetched) == 1
    assert [p.name for p in tmp_path.iterdir()] == [f"{SHA}.gguf"]


# ---- models that exist only on the hosts (Ollama store, path) ----------------------------------

ON_HOSTS = """cluster: ollama-seed
llama_cpp: {ref: b11312}
hosts:
  box16: {address: 10.0.0.6, backend: cuda}
  box11:
    address: 10.0.0.5
    backend: cuda
    rpc_servers: [{port: 50052, cache: true}]
models:
  gemma27: SOURCE
servers:
  main: {host: box16, model: gemma27, port: 8080, bind: 127.0.0.1, ctx_size: 32768,
         tensor_split: [11, 16]}
"""
DIGEST = "b1" * 32


def ollama_fact(digest=DIGEST):
    manifest = ('{"layers": [{"mediaType": "application/vnd.ollama.image.model", '
                f'"digest": "sha256:{digest}", "size": 17000000000}}]}}')
    return {"manifest": manifest, "store": "/usr/share/ollama/.ollama/models",
            "blobs": {f"sha256:{digest}": [17_000_000_000, 1718000000]}, "heads": {}}


def on_hosts_cluster(tmp_path, source: str):
    path = tmp_path / "cluster.yaml"
    path.write_text(ON_HOSTS.replace("SOURCE", source))
    return load_cluster(path)


def header_bytes_of(header, tmp_path) -> bytes:
    """A real GGUF header (written by gguf) with the stand-in's fields and tensor list."""
    out = tmp_path / "header.gguf"
    w = GGUFWriter(str(out), "gemma3")
    for key, value in header.fields.items():
        if key != "general.architecture":
            w.add_uint32(key, value)
    for name, _offset, size in header.tensors:
        w.add_tensor_info(name, (size,), np.dtype(np.int8), size, raw_dtype=GGMLQuantizationType.I8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return out.read_bytes()


def test_a_worker_seeds_from_its_own_ollama_store(tmp_path):
    cluster = on_hosts_cluster(tmp_path, "{ollama: {model: 'gemma3:27b'}}")
    facts = {h: {**GPU_FACTS[h], "models.OllamaManifest[gemma27]": ollama_fact()}
             for h in GPU_FACTS}
    reads = []
    data = header_bytes_of(gemma27_header(), tmp_path)

    def read_remote(host, path):
        reads.append((host, path))
        return data

    for _ in range(2):  # the second plan finds the header in the cache: nothing is read
        resolved = run_values()
        planned = seeding.prepare(cluster, cluster.hosts, facts, resolved,
                                header_cache=tmp_path / "headers", read_remote=read_remote)
        assert planned.notes == ()
        (seed,) = planned.seeds["box11:50052"]
        assert seed.model_sha == DIGEST  # the blob's own sha256 names the content
        assert seed.model_path == "/opt/meshdeploy/models/gemma27/model.gguf"
        assert {t.layer for t in seed.tensors} == set(range(26))
        assert planned.layouts[0].rows[0]["layers"] == "0-25"
    # Read once, from the worker that seeds, at its blob.
    assert reads == [("box11", f"/usr/share/ollama/.ollama/models/blobs/sha256-{DIGEST}")]


def test_a_worker_seeds_from_a_path_named_by_size_and_mtime(tmp_path):
    cluster = on_hosts_cluster(tmp_path, "{path: /models/gemma-27b.gguf}")
    file = {"size": 17_000_000_000, "mtime": 1718000000, "verified": None, "partial": None,
            "link": None}
    facts = {h: {**GPU_FACTS[h], "models.ModelFile[gemma27]": file} for h in GPU_FACTS}
    data = header_bytes_of(gemma27_header(), tmp_path)
    resolved = run_values()
    planned = seeding.prepare(cluster, cluster.hosts, facts, resolved, read_remote=lambda h, p: data)
    (seed,) = planned.seeds["box11:50052"]
    assert (seed.model_sha, seed.model_path) == ("path-17000000000-1718000000",
                                                 "/models/gemma-27b.gguf")
    # The worker holds the file: models.gguf checks it there as on the orchestrator.
    assert models.needed(cluster, cluster.host("box11")) == ["gemma27"]


def test_a_model_not_yet_on_the_worker_waits_for_the_next_plan(tmp_path):
    cluster = on_hosts_cluster(tmp_path, "{path: /models/gemma-27b.gguf}")
    resolved = run_values()
    planned = seeding.prepare(cluster, cluster.hosts, GPU_FACTS, resolved,
                            read_remote=lambda h, p: pytest.fail("nothing to read"))
    assert planned.seeds == {} and planned.layouts == ()
    assert list(planned.notes) == [
        "servers.main: gemma27 is not on the probed hosts yet; its placement and seeding are "
        "computed by the plan after it is",
        "servers.main: no failover until a plan computes its placements: llama-server runs "
        "unsupervised, and a lost worker stops it"]


def test_an_unreadable_header_on_a_host_is_one_error(tmp_path):
    cluster = on_hosts_cluster(tmp_path, "{path: /models/gemma-27b.gguf}")
    file = {"size": 5, "mtime": 1, "verified": None, "partial": None, "link": None}
    facts = {h: {**GPU_FACTS[h], "models.ModelFile[gemma27]": file} for h in GPU_FACTS}
    with pytest.raises(PlanError, match=r"models.gemma27: cannot read the GGUF header: "
                                        r"not a GGUF file \(bad magic\)"):
        planned = seeding.prepare(cluster, cluster.hosts, facts, run_values(),
                        read_remote=lambda h, p: b"NOPE" * 10)


def test_fetch_false_keeps_a_whole_copy_on_the_worker(tmp_path):
    text = (ROOT / "inventories" / "two-cuda-11-16.yaml").read_text()
    text = text.replace("        cache: true ", "        fetch: false\n        cache: true ")
    assert "fetch: false" in text
    path = tmp_path / "two.yaml"
    path.write_text(text)
    cluster = load_cluster(path)
    assert distribution.tensor_fetches(cluster) == []
    assert models.needed(cluster, cluster.host("box11")) == ["gemma27"]
    fetching = load_cluster(ROOT / "inventories" / "two-cuda-11-16.yaml")
    assert [tuple(f) for f in distribution.tensor_fetches(fetching)] == [("gemma27", "box16", "box11")]
    assert list(distribution.shares(fetching, fetching.host("box16"))) == ["gemma27"]


def test_a_new_vulkan_host_is_told_why_its_memory_is_unknown(tmp_path):
    """A new vulkan host gets vulkaninfo with the Vulkan packages of its first apply: until
    then no plan can read its memory, and the note says so and what to do."""
    text = (ROOT / "tests/data/vulkan-rocm.yaml").read_text()
    path = tmp_path / "vk.yaml"
    path.write_text(text.replace("    tensor_split: [0.5, 0.5]\n", ""))
    cluster = load_cluster(path)

    def notes(tools):
        facts = {h.name: {"toolchain.Platform": {"kernel": "Linux", "tools": tools}}
                 for h in cluster.hosts}
        planned = seeding.prepare(cluster, cluster.hosts, facts, run_values())
        (note,) = [n for n in planned.notes if "is unknown" in n]
        return note
    assert notes(["cmake"]).endswith(
        "placement not checked (vulkaninfo is not on vulkan-box yet: apply installs it with the "
        "Vulkan packages, and the plan after that apply reads the memory; apply again then)")
    assert notes(["cmake", "vulkaninfo"]).endswith("placement not checked")


def without_node3(cluster, tmp_path, run=("node1", "node2")):
    """seeding.prepare of the lab's cluster as `plan --limit node1,node2` runs it: node3 away
    (`run`: the hosts of another --limit)."""
    from support.device_facts import cpu
    resolved = run_values(models={"gemma": HfResolved("r", "c" * 40, (HfFile("f", 1, SHA, "u"),),
                                                      api=HUB)})
    facts = {h: cpu(25_183_293_440, 22_800_000_000) for h in run}
    import meshdeploy.roles.rpc_cache.seeding as mod
    original = mod.read_header
    mod.read_header = lambda _path: gemma27_header()
    try:
        return seeding.prepare(cluster, [cluster.host(h) for h in run], facts,
                               resolved, fetch=lambda *a, **k: tmp_path.joinpath("h").touch()
                               or tmp_path / "h")
    finally:
        mod.read_header = original


def test_a_worker_left_out_by_limit_is_named_once_not_as_unknown_memory(tmp_path):
    """plan --limit node1,node2 with node3 away: services leaves the server's unit, placements
    and failover as they are (services.llama_server), so the plan says that, not that node3's
    memory is unknown or that the server runs without failover."""
    planned = without_node3(load_cluster(ROOT / "inventories" / "lab.yaml"), tmp_path)
    assert list(planned.notes) == [
        "servers.main: node3 not in this run (--limit): the server's placements and failover "
        "are left as applied"]


def test_a_cached_worker_in_the_run_keeps_its_seeds_while_another_worker_is_left_out(tmp_path):
    """tensor_split auto splits by every worker's free memory: with node3 left out (--limit),
    which tensors node2's cache holds is not known. The plan goes on (it failed as a whole,
    "free memory of node3 ... is unknown"), says node3 is left out once, and node2's
    cache is left as seeded rather than pruned to nothing."""
    from meshdeploy.core.context import HostContext

    text = (ROOT / "inventories" / "lab.yaml").read_text().replace(
        "    rpc_servers:\n      - port: 50052\n", "    rpc_servers:\n      - {port: 50052, cache: true}\n")
    path = tmp_path / "cached.yaml"
    path.write_text(text)
    cluster = load_cluster(path)
    assert cluster.host("node2").rpc_server(50052).cache
    planned = without_node3(cluster, tmp_path)
    assert list(planned.notes) == [
        "servers.main: node3 not in this run (--limit): the server's placements and failover "
        "are left as applied"]
    assert planned.kept == {"node2:50052": "servers.main splits by free memory and node3 is "
                                           "not in this run (--limit)"}
    assert "node2:50052" not in planned.seeds
    ctx = HostContext(cluster, cluster.host("node2"), {}, run_values(kept=planned.kept),
                      cluster_facts={"node1": {}, "node2": {}})
    step = seeding.seed(ctx, 50052)
    assert (step.change.action, step.change.reason) == (
        "no-op", "left as seeded: servers.main splits by free memory and node3 is not in this "
                 "run (--limit)")


def test_a_run_of_one_cached_worker_alone_keeps_its_seeds(tmp_path):
    """`plan --limit node3`: neither the orchestrator nor node2 is read, node3's cache is
    left as seeded (the plan failed as a whole: node2's memory unknown)."""
    text = (ROOT / "inventories" / "lab.yaml").read_text().replace(
        "    rpc_servers:\n      - port: 50052\n", "    rpc_servers:\n      - {port: 50052, cache: true}\n")
    path = tmp_path / "cached.yaml"
    path.write_text(text)
    planned = without_node3(load_cluster(path), tmp_path, run=("node3",))
    assert list(planned.kept) == ["node3:50052"] and "node2" in planned.kept["node3:50052"]
    assert planned.seeds == {} and planned.notes == ()
