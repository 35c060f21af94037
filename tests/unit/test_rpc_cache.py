"""rpc_cache: md-rpc-seed compiled and run here, GGUF tensor lists, header-only HTTP reads,
and the seed/seed_tool resources as fixtures (facts in, Step out)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.model import system_layout
from meshdeploy.core.context import HostContext
from meshdeploy.core.probe import compose, decode, marker, split
from meshdeploy.errors import PlanError
from meshdeploy.placement import defaults as placement_defaults
from meshdeploy.placement import tensors as T
from meshdeploy.roles.rpc_cache import defaults as d
from meshdeploy.roles.rpc_cache import operations as ops
from meshdeploy.roles.rpc_cache.facts import CacheDir, SeedTool

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024
GEMMA_EMBD = ("token_embd.weight", 6527680, 178257920, "f42cfb619b3cade9")


def fnv1a(data: bytes) -> str:
    """Reference FNV-1a 64 (ggml-rpc.cpp fnv_hash); pure Python, so only for small ranges."""
    h = 0xcbf29ce484222325
    prime = 0x100000001b3
    mask = (1 << 64) - 1
    for b in data:
        h = ((h ^ b) * prime) & mask
    return f"{h:016x}"


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory) -> Path:
    """A llama-shaped GGUF: 3 blocks, each with one 12 MiB tensor (> threshold) and small ones."""
    path = tmp_path_factory.mktemp("gguf") / "synthetic.gguf"
    rng = np.random.default_rng(7)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(3)
    w.add_context_length(4096)
    w.add_embedding_length(256)
    w.add_head_count(8)
    w.add_head_count_kv(2)
    w.add_tensor("token_embd.weight", rng.integers(-128, 128, 11 * MiB, dtype=np.int8))
    for i in range(3):
        w.add_tensor(f"blk.{i}.ffn_up.weight", rng.integers(-128, 128, 12 * MiB, dtype=np.int8))
        w.add_tensor(f"blk.{i}.attn_k.weight", rng.standard_normal(4096).astype(np.float32))
        w.add_tensor(f"blk.{i}.attn_norm.weight", rng.standard_normal(256).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(256).astype(np.float32))
    w.add_tensor("output.weight", rng.integers(-128, 128, 10 * MiB, dtype=np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def run_seed(tool: Path, gguf: Path, cache: Path, pairs, *extra) -> subprocess.CompletedProcess:
    listing = "".join(f"{o} {s}\n" for o, s in pairs)
    return subprocess.run([str(tool), *extra, str(gguf), str(cache)], input=listing, text=True,
                          capture_output=True)


# ---- md-rpc-seed ----------------------------------------------------------------------------------

def test_hash_mode_matches_reference_fnv1a(seed_bin, synthetic):
    data = synthetic.read_bytes()
    for off, size in ((0, 0), (0, 1), (3, 777), (4093, 9000), (12345, 300_000)):
        out = subprocess.run([str(seed_bin), "--hash", str(synthetic), str(off), str(size)],
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == fnv1a(data[off:off + size])


def test_hash_mode_refuses_range_past_end(seed_bin, synthetic):
    size = synthetic.stat().st_size
    r = subprocess.run([str(seed_bin), "--hash", str(synthetic), str(size - 10), "11"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "past the end" in r.stderr


def test_seed_writes_exact_bytes_then_keeps(seed_bin, synthetic, tmp_path):
    hashed = [t for t in T.weight_tensors(synthetic) if t.hashed]
    assert [t.name for t in hashed] == ["token_embd.weight", "blk.0.ffn_up.weight",
                                        "blk.1.ffn_up.weight", "blk.2.ffn_up.weight"]
    pairs = [(t.offset, t.size) for t in hashed]
    first = run_seed(seed_bin, synthetic, tmp_path, pairs)
    assert first.returncode == 0, first.stderr
    data = synthetic.read_bytes()
    lines = first.stdout.splitlines()
    assert len(lines) == 4
    for t, line in zip(hashed, lines):
        name, size, state = line.split()
        assert (int(size), state) == (t.size, "written")
        assert (tmp_path / name).read_bytes() == data[t.offset:t.offset + t.size]
    # The name is the hash of the entry's own bytes (the algorithm is checked against the
    # reference in test_hash_mode_matches_reference_fnv1a and against gemma's known value).
    for line in lines:
        name = line.split()[0]
        out = subprocess.run([str(seed_bin), "--hash", str(tmp_path / name), "0",
                              str((tmp_path / name).stat().st_size)],
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == name
    again = run_seed(seed_bin, synthetic, tmp_path, pairs, "--verify")
    assert again.returncode == 0
    assert [line.split()[2] for line in again.stdout.splitlines()] == ["kept"] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(line.split()[0] for line in lines)


def test_truncated_or_corrupt_entry_is_replaced(seed_bin, synthetic, tmp_path):
    t = next(t for t in T.weight_tensors(synthetic) if t.name == "blk.1.ffn_up.weight")
    data = synthetic.read_bytes()[t.offset:t.offset + t.size]
    name = run_seed(seed_bin, synthetic, tmp_path, [(t.offset, t.size)]).stdout.split()[0]
    entry = tmp_path / name
    entry.write_bytes(data[: t.size // 2])  # what a killed rpc-server leaves behind
    r = run_seed(seed_bin, synthetic, tmp_path, [(t.offset, t.size)])
    assert r.stdout.split()[2] == "written" and entry.read_bytes() == data
    # Same size, wrong bytes: only --verify notices.
    entry.write_bytes(b"\0" * t.size)
    assert run_seed(seed_bin, synthetic, tmp_path, [(t.offset, t.size)]).stdout.split()[2] == "kept"
    r = run_seed(seed_bin, synthetic, tmp_path, [(t.offset, t.size)], "--verify")
    assert r.stdout.split()[2] == "written" and entry.read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary left


def test_failure_leaves_no_entry(seed_bin, synthetic, tmp_path):
    size = synthetic.stat().st_size
    r = run_seed(seed_bin, synthetic, tmp_path, [(size - 100, 200)])
    assert r.returncode != 0 and "past the end" in r.stderr
    bad = run_seed(seed_bin, synthetic, tmp_path, [("12x", 4)])
    assert bad.returncode != 0 and "expected \"<offset> <size>\"" in bad.stderr
    missing = run_seed(seed_bin, synthetic, tmp_path / "nope", [(0, 4)])
    assert missing.returncode != 0 and "cache directory" in missing.stderr
    assert list(tmp_path.iterdir()) == []


def test_gemma_token_embd_hash_and_speed(seed_bin, gemma, tmp_path):
    name, off, size, want = GEMMA_EMBD
    t0 = time.perf_counter()
    out = subprocess.run([str(seed_bin), "--hash", str(gemma), str(off), str(size)],
                         capture_output=True, text=True, check=True).stdout.strip()
    seconds = time.perf_counter() - t0
    assert out == want
    r = run_seed(seed_bin, gemma, tmp_path, [(off, size)])
    assert r.stdout.split() == [want, str(size), "written"]
    assert (tmp_path / want).stat().st_size == size
    print(f"\nmd-rpc-seed FNV-1a: {size / seconds / 1e9:.2f} GB/s ({size / 1e6:.0f} MB, "
          f"{seconds:.3f} s, page cache warm)")


# ---- tensors -------------------------------------------------------------------------------------

def test_weight_tensors_match_reader_and_bytes(synthetic):
    reader = GGUFReader(synthetic)
    tensors = T.weight_tensors(reader)
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    data = synthetic.read_bytes()
    for t, rt in zip(tensors, reader.tensors):
        assert data[t.offset:t.offset + t.size] == rt.data.tobytes()
    by_name = {t.name: t for t in tensors}
    assert by_name["blk.2.attn_k.weight"].layer == 2
    assert by_name["output.weight"].layer is None
    # Exactly 10 MiB is not above the threshold: rpc-server sends it whole.
    assert by_name["output.weight"].size == placement_defaults.placement_hash_threshold
    assert not by_name["output.weight"].hashed


def test_model_shape_synthetic(synthetic):
    s = T.model_shape(GGUFReader(synthetic))
    layer = 12 * MiB + 4096 * 4 + 256 * 4
    assert s["n_layers"] == 3 and s["layer_bytes"] == [layer] * 3
    assert s["input_bytes"] == 11 * MiB and s["output_bytes"] == 10 * MiB + 256 * 4
    assert not s["tied_output"] and s["output_device_bytes"] == s["output_bytes"]
    # head_dim = 256 / 8 = 32; K and V of 2 KV heads, f16: (2*32 + 2*32) * 2 bytes per layer.
    assert s["k_elems_layer"] == s["v_elems_layer"] == [64] * 3
    assert s["swa_layers"] == [False] * 3 and s["n_swa"] == 0  # llama: no sliding window
    assert s["n_ctx_train"] == 4096


def test_fast_header_equals_gguf_reader(synthetic):
    fast, slow = T.read_header(synthetic), T.read_header(GGUFReader(synthetic))
    assert fast.tensors == slow.tensors and fast.data_offset == slow.data_offset
    for key in ("general.architecture", "llama.block_count", "llama.attention.head_count_kv",
                "llama.context_length", "llama.embedding_length"):
        assert fast.fields[key] == slow.fields[key]
    assert T.model_shape(synthetic) == T.model_shape(GGUFReader(synthetic))


def test_gemma_tensors_and_shape(gemma):
    # Offsets and sizes as GGUFReader reports them for this file (checked once; GGUFReader
    # takes ~15 s on its 262k-token vocabulary, the header parser well under a second).
    tensors = T.weight_tensors(gemma)
    assert len(tensors) == 236
    hashed = [t for t in tensors if t.hashed]
    assert [(t.name, t.offset, t.size) for t in hashed] == [GEMMA_EMBD[:3]]
    s = T.model_shape(gemma)
    assert (s["arch"], s["n_layers"], s["n_ctx_train"]) == ("gemma3", 18, 32768)
    # 1 KV head, key/value length 256; gemma3 slides a 512-token window in 5 layers of 6.
    assert s["k_elems_layer"] == s["v_elems_layer"] == [256] * 18
    assert s["n_swa"] == 512
    assert [il for il in range(18) if not s["swa_layers"][il]] == [5, 11, 17]
    assert s["tied_output"] and s["output_device_bytes"] == 2560 + 178257920
    assert s["input_bytes"] + s["output_bytes"] + sum(s["layer_bytes"]) == \
        sum(t.size for t in tensors)


def test_header_end_needs_more_bytes(synthetic):
    data = synthetic.read_bytes()
    end = T.header_end(data)
    assert end == GGUFReader(synthetic).data_offset
    assert T.header_end(data[: end - 40]) is None
    with pytest.raises(T.GgufHeaderError, match="bad magic"):
        T.header_end(b"GGML" + data[4:100])


def test_a_vocabulary_cut_anywhere_is_more_bytes_to_read(gemma):
    """gemma's 262k-token vocabulary is skipped by its strings' lengths, none decoded: a header
    cut inside it (or inside one of its strings) is incomplete, never a header."""
    with open(gemma, "rb") as f:
        data = f.read(7 * MiB)
    end = T.header_end(data)
    assert end == T.read_header(gemma).data_offset and end > 6 * MiB
    for cut in (2 * MiB, 2 * MiB + 3, 4 * MiB + 1, end - 40):
        assert T.header_end(data[:cut]) is None, cut
    fields = T.read_header(gemma).fields
    assert "tokenizer.ggml.tokens" not in fields and "tokenizer.ggml.scores" not in fields
    assert fields["tokenizer.ggml.model"] == "llama" and fields["gemma3.block_count"] == 18


class _CountingHandler:
    """Mixed into the mirror's handler: bytes of file bodies sent, and the Authorization seen."""

    sent = 0
    auth: list = []

    def send_body(self, f, offset, count):
        type(self).sent += count
        super().send_body(f, offset, count)

    def parse_request(self):
        ok = super().parse_request()
        if ok:
            type(self).auth.append(self.headers.get("Authorization"))
        return ok


def _mirror(root):
    from meshdeploy.lab import hfmirror

    handler = type("Counting", (_CountingHandler, hfmirror.MirrorHandler), {"sent": 0, "auth": []})
    server = hfmirror.make_server(root, "127.0.0.1", 0, handler=handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler


def test_header_from_http_reads_only_the_header(synthetic, tmp_path):
    from meshdeploy.lab import hfstore

    info = hfstore.add_file(tmp_path / "hf", "org/synth", "m.gguf", synthetic)
    server, handler = _mirror(tmp_path / "hf")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/org/synth/resolve/main/m.gguf"
        path = T.header_from_http(url, info["size"], token="s3cret", dest=tmp_path / "h.gguf")
    finally:
        server.shutdown()
        server.server_close()
    assert path.stat().st_size == info["size"]
    assert T.weight_tensors(path) == T.weight_tensors(synthetic)
    assert handler.sent < info["size"] / 20, (handler.sent, info["size"])
    assert path.stat().st_blocks * 512 < info["size"] / 20  # sparse: the weights are a hole
    assert handler.auth and all(a == "Bearer s3cret" for a in handler.auth)


def test_header_from_http_errors(synthetic, tmp_path):
    from meshdeploy.lab import hfstore

    hfstore.add_file(tmp_path / "hf", "org/synth", "m.gguf", synthetic)
    server, _ = _mirror(tmp_path / "hf")
    base = f"http://127.0.0.1:{server.server_address[1]}/org/synth/resolve/main"
    try:
        with pytest.raises(T.GgufHeaderError, match="HTTP 404"):
            T.header_from_http(f"{base}/absent.gguf", 1000)
        with pytest.raises(T.GgufHeaderError, match="is the size right"):
            T.header_from_http(f"{base}/m.gguf", 100)
    finally:
        server.shutdown()
        server.server_close()


def test_gemma_header_from_http(gemma, tmp_path):
    from meshdeploy.lab import hfstore

    info = hfstore.add_file(tmp_path / "hf", "org/gemma", "g.gguf", gemma)
    server, handler = _mirror(tmp_path / "hf")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/org/gemma/resolve/main/g.gguf"
        path = T.header_from_http(url, info["size"], dest=tmp_path / "g.gguf")
    finally:
        server.shutdown()
        server.server_close()
    assert T.weight_tensors(path) == T.weight_tensors(gemma)
    # The header is 6.5 MB (a 262k-token vocabulary); the file 253 MB.
    assert handler.sent < 30 * MiB


# ---- facts ----------------------------------------------------------------------------------------

def decoded(key, fact, kwargs, lines):
    from meshdeploy.core.probe import Section

    section = Section(key, fact, kwargs)
    assert isinstance(compose([section], "n0nce"), str)
    return decode([section], split([marker("n0nce", 0), *lines], [section], "n0nce"))[key]


def test_cache_dir_fact_runs_against_a_real_dir(tmp_path):
    (tmp_path / "f42cfb619b3cade9").write_bytes(b"x" * 10)
    (tmp_path / ".0000000000000001.tmp").write_bytes(b"y")
    (tmp_path / ".editor.tmp").write_bytes(b"not ours")
    (tmp_path / d.rpc_cache_marker).write_text(f"{'a' * 64} 6527680 10 f42cfb619b3cade9\n")
    (tmp_path / "notes.txt").write_text("ignored")
    command = CacheDir().command(path=str(tmp_path))
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    value = CacheDir().process(out.stdout.splitlines())
    assert value == {"entries": {"f42cfb619b3cade9": 10},
                     "temporary": [".0000000000000001.tmp"],
                     "marker": [("a" * 64, 6527680, 10, "f42cfb619b3cade9")]}
    gone = subprocess.run(["sh", "-c", CacheDir().command(path=str(tmp_path / "x"))],
                          capture_output=True, text=True, check=True)
    assert CacheDir().process(gone.stdout.splitlines()) is None


def test_seed_tool_fact(tmp_path):
    tool = tmp_path / "md-rpc-seed"
    run = lambda: SeedTool().process(subprocess.run(  # noqa: E731
        ["sh", "-c", SeedTool().command(path=str(tool))], capture_output=True, text=True).stdout
        .splitlines())
    assert run() is None
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert run() == {"source_sha256": None}
    Path(f"{tool}{d.rpc_cache_tool_source_suffix}").write_text("b" * 64 + "\n")
    assert run() == {"source_sha256": "b" * 64}


# ---- operations (fixtures: facts in, Step out) ----------------------------------------------------

SHA = "a" * 64
OLD = "c" * 64


def ctx_for(facts, host="node2", cache=True):
    """The lab inventory, with the rpc-server cache (-c) switched as asked (off by default)."""
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    hosts = [replace(h, rpc_servers=tuple(replace(r, cache=cache) for r in h.rpc_servers))
             for h in cluster.hosts]
    cluster = replace(cluster, hosts=tuple(hosts))
    return HostContext(cluster, cluster.host(host), facts, run_values())


TENSORS = [T.Tensor("blk.9.ffn_up.weight", 1000, 20 * MiB, 9),
           T.Tensor("blk.9.ffn_down.weight", 1000 + 20 * MiB, 20 * MiB, 9),
           T.Tensor("blk.9.attn_k.weight", 1000 + 40 * MiB, 4 * MiB, 9)]
H1, H2, H3 = "1111111111111111", "2222222222222222", "3333333333333333"
CACHE = d.cache_dir_for(system_layout("/opt/meshdeploy"), 50052)
MODEL = "/opt/meshdeploy/models/m/m.gguf"


def seed_step(facts, **kw):
    return ops.seed(ctx_for({"rpc_cache.CacheDir[50052]": facts}, **kw), 50052, MODEL, TENSORS,
                    CACHE, SHA)


def test_seed_empty_cache_creates():
    step = seed_step(None)
    c = step.change
    assert c.action == "create" and c.address == "node2/rpc_cache.seed[50052]"
    assert c.reason == (f"0.04 GB to seed from {MODEL}; 4.2 MB of small tensors still cross "
                        "the network at each load")
    (script,) = step.commands
    assert f"1000 {20 * MiB}\n{1000 + 20 * MiB} {20 * MiB}\n" in script
    assert f"{1000 + 40 * MiB} " not in script  # the 4 MiB tensor is not cached by rpc-server
    assert f"seed_one /opt/meshdeploy/tools/md-rpc-seed {MODEL} {SHA} <<" in script
    assert '"$1" "$2" "$D" < "$L" > "$L.out"' in script


def test_seed_marker_covers_all_noop():
    facts = {"entries": {H1: 20 * MiB, H2: 20 * MiB}, "temporary": [],
             "marker": [(SHA, 1000, 20 * MiB, H1), (SHA, 1000 + 20 * MiB, 20 * MiB, H2)]}
    step = seed_step(facts)
    assert step.noop and step.change.reason == f"2 tensors (0.04 GB) seeded for {SHA[:12]}"


def test_seed_truncated_entry_reseeds_without_deleting_it():
    facts = {"entries": {H1: 20 * MiB, H2: 5 * MiB}, "temporary": [],
             "marker": [(SHA, 1000, 20 * MiB, H1), (SHA, 1000 + 20 * MiB, 20 * MiB, H2)]}
    step = seed_step(facts)
    assert step.change.action == "update"
    assert [(a.name, a.before, a.after) for a in step.change.diffs] == \
        [("seeded", "1 tensors", "2 tensors (+21.0 MB)")]
    (script,) = step.commands
    assert f"{1000 + 20 * MiB} {20 * MiB}\n" in script and f"\n1000 {20 * MiB}\n" not in script
    assert f"{SHA} 1000 {20 * MiB} {H1}\n" in script  # the good entry stays in the marker


def test_seed_stale_entries_of_old_model_deleted():
    facts = {"entries": {H1: 20 * MiB, H2: 20 * MiB, H3: 30 * MiB},
             "temporary": [".1234567890abcdef.tmp"],
             "marker": [(SHA, 1000, 20 * MiB, H1), (SHA, 1000 + 20 * MiB, 20 * MiB, H2),
                        (OLD, 5, 30 * MiB, H3)]}
    step = seed_step(facts)
    assert step.change.action == "delete"
    assert [(a.name, a.before) for a in step.change.diffs] == \
        [("stale entries", "1 (31.5 MB)"), ("interrupted writes", ".1234567890abcdef.tmp")]
    (script,) = step.commands
    assert OLD not in script and "tools/md-rpc-seed" not in script


def test_seed_keeps_other_deployed_model():
    facts = {"entries": {H1: 20 * MiB, H2: 20 * MiB, H3: 30 * MiB}, "temporary": [],
             "marker": [(SHA, 1000, 20 * MiB, H1), (SHA, 1000 + 20 * MiB, 20 * MiB, H2),
                        (OLD, 5, 30 * MiB, H3)]}
    other = ops.SeedModel("/m/old.gguf", OLD, (T.Tensor("blk.0.x", 5, 30 * MiB, 0),))
    step = ops.seed(ctx_for({"rpc_cache.CacheDir[50052]": facts}), 50052, MODEL, TENSORS, CACHE,
                    SHA, also=(other,))
    assert step.noop


def test_seed_not_here_or_cache_off():
    assert ops.seed(ctx_for({}, host="node1"), 50052, MODEL, TENSORS, CACHE, SHA).noop
    off = ops.seed(ctx_for({}, cache=False), 50052, MODEL, TENSORS, CACHE, SHA)
    assert off.noop and off.change.reason == "cache off for this rpc-server"
    with pytest.raises(PlanError, match="model sha"):
        ops.seed(ctx_for({}), 50052, MODEL, TENSORS, CACHE, "")


def test_seed_tool_steps():
    want = ops.source_sha256()
    fresh = ops.seed_tool(ctx_for({"rpc_cache.SeedTool": None}))
    assert fresh.change.action == "create" and len(fresh.commands) == 2
    assert "CC='cc -O2'\nBIN=/opt/meshdeploy/tools/md-rpc-seed\n" in fresh.commands[1]
    assert '$CC -o "$BIN.tmp" "$SRC"' in fresh.commands[1]
    assert want in fresh.commands[1]
    stale = ops.seed_tool(ctx_for({"rpc_cache.SeedTool": {"source_sha256": "0" * 64}}))
    assert stale.change.action == "update" and stale.change.diffs[0].before == "0" * 12
    assert ops.seed_tool(ctx_for({"rpc_cache.SeedTool": {"source_sha256": want}})).noop
    # node1 has no rpc-server, but its gemma is what the cached workers fetch tensors of: it
    # makes the digest list with the tool. With the caches off it needs none.
    assert ops.seed_tool(ctx_for({}, host="node1")).change.action == "create"
    assert ops.seed_tool(ctx_for({}, host="node1", cache=False)).noop
    assert [s.key for s in ops.sections(ctx_for({}).cluster, ctx_for({}).host)] == \
        ["rpc_cache.DeviceMemory", "rpc_cache.SeedTool", "rpc_cache.CacheFree",
         "rpc_cache.CacheDir[50052]"]


# ---- the generated shell script, run for real -----------------------------------------------------

def test_seed_script_runs_end_to_end(seed_bin, synthetic, tmp_path):
    """Plan -> run the commands -> facts again -> no-op; then a new model makes the old stale."""
    prefix = tmp_path / "prefix"
    (prefix / "tools").mkdir(parents=True)
    shutil.copy(seed_bin, prefix / "tools" / "md-rpc-seed")
    cache = tmp_path / "cache" / "rpc"
    tensors = [t for t in T.weight_tensors(synthetic) if t.layer in (0, 1)]

    def plan(sha, tensors):
        facts_out = subprocess.run(["sh", "-c", CacheDir().command(path=str(cache))],
                                   capture_output=True, text=True, check=True).stdout.splitlines()
        ctx = ctx_for({"rpc_cache.CacheDir[50052]": CacheDir().process(facts_out)})
        step = ops.seed(ctx, 50052, str(synthetic), tensors, str(cache), sha)
        return step, [c.replace("/opt/meshdeploy/tools/md-rpc-seed",
                                 str(prefix / "tools" / "md-rpc-seed")) for c in step.commands]

    step, commands = plan(SHA, tensors)
    assert step.change.action == "create"
    for c in commands:
        subprocess.run(["sh", "-c", c], check=True)
    names = sorted(p.name for p in cache.iterdir())
    assert len([n for n in names if not n.startswith(".")]) == 2 and names[0] == d.rpc_cache_marker
    step, _ = plan(SHA, tensors)
    assert step.noop, step.change
    # Another model (other sha) on this port: the first model's entries become stale.
    step, commands = plan(OLD, tensors[:3])
    assert step.change.action == "create"
    for c in commands:
        subprocess.run(["sh", "-c", c], check=True)
    marker = (cache / d.rpc_cache_marker).read_text().split()
    assert marker[0] == OLD and len(marker) == 4
    assert sorted(p.name for p in cache.iterdir()) == sorted([d.rpc_cache_marker, marker[3]])
