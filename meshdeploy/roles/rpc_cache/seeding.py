"""From the cluster file to each llama-server's placement and what each cached rpc-server holds.

Computed once per plan on the control machine: the GGUF header is read with Range requests from
the control machine's view of the hub (huggingface.api_endpoint), never from a host, and
llama.cpp's layer split is reproduced for every llama-server whose model is a one-file Hub
model (layout.py), refusing one that cannot fit. The result (the role's run values: layouts,
seeds)
feeds the plan's placement table and rpc_cache.seed[port].
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshdeploy.config.model import rpc_ref
from meshdeploy.config.sources import HfSource, OllamaSource
from meshdeploy.config import distribution
from meshdeploy.core.context import HostContext, Step
from meshdeploy.core.paths import model_path, ollama_blob
from meshdeploy.errors import PlanError
from meshdeploy.roles.rpc_cache import defaults as d
from meshdeploy.placement import failover, layout
from meshdeploy.roles.rpc_cache import operations as ops
from meshdeploy.roles.rpc_cache import run
from meshdeploy.placement.tensors import (
    GgufHeaderError,
    header_from_http,
    model_shape,
    read_header,
    weight_tensors,
)


def header_url(model, hf_model) -> str:
    """The control machine's URL of the model's first file, at the endpoint the models role
    resolved it on (HfResolved.api), pinned to the resolved commit."""
    src = model.source
    if not hf_model.api.startswith(("http://", "https://")):
        raise PlanError(f"models.{model.name}: resolved without an http(s) endpoint "
                        f"({hf_model.api!r}); its header cannot be read")
    return f"{hf_model.api.rstrip('/')}/{src.repo}/resolve/{hf_model.commit}/{src.files[0]}"


# The roles whose run values seeding reads (Resolved.value): the models as the hub resolved
# them (and the token for gated ones), the commit the workers run.
MODELS, LLAMA_CPP = "models", "llama_cpp"

_CACHE_KEY = re.compile(r"[0-9a-f]{64}")


def cache_file(cache: Path, key: str, where: str) -> Path:
    """cache/<key>.gguf for a sha256 key; the key comes from a Hub answer or a host's manifest,
    so anything else (a '../../x' path) is refused and the result must stay inside `cache`."""
    if not isinstance(key, str) or not _CACHE_KEY.fullmatch(key):
        raise PlanError(f"{where}: content id {key!r} is not a sha256; refusing to name a cache "
                        "file after it", hint="check the model's source (endpoint or Ollama store)")
    path = (cache / f"{key}.gguf").resolve()
    if path.parent != cache.resolve():
        raise PlanError(f"{where}: cache file {path} is outside {cache}")
    return path


# Headers parsed in this process, by cache file (named by the content's sha256) as it was when
# parsed (modification time and size): a plan parses a model's header once however many
# servers, names or hosts ask for it.
_PARSED: dict = {}


def _kept(cache: Path | None, key: str, produce, where: str, hint: str):
    """A parsed header, from `cache`/<key>.gguf or from produce(dest) (which writes the header
    bytes to dest and returns the path it wrote); only a header that parsed is kept."""
    kept = cache_file(cache, key, where) if cache else None
    path = None
    try:
        if kept is not None and kept.exists():
            seen = (kept, kept.stat().st_mtime_ns, kept.stat().st_size)
            if seen not in _PARSED:
                _PARSED[seen] = read_header(str(kept))
            return _PARSED[seen]
        dest = None
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            # A fresh name, never `<key>.tmp`: a link planted there would be written through.
            fd, name = tempfile.mkstemp(prefix=f".{kept.stem}.", suffix=".tmp", dir=kept.parent)
            os.close(fd)
            path = dest = Path(name)
        path = produce(dest)
        header = read_header(str(path))
        if kept is not None:
            os.replace(path, kept)
            path = None
            _PARSED[(kept, kept.stat().st_mtime_ns, kept.stat().st_size)] = header
        return header
    except GgufHeaderError as exc:
        raise PlanError(f"{where}: cannot read the GGUF header: {exc}", hint=hint) from None
    finally:
        if path is not None:
            os.unlink(path)


def _hub_header(cluster, model, hf_model, token, fetch, cache, where):
    url = header_url(model, hf_model)
    file = hf_model.files[0]

    def produce(dest):
        return fetch(url, file.size, token=token, dest=dest) if dest is not None \
            else fetch(url, file.size, token=token)
    return _kept(cache, file.sha256, produce, where,
                 "check huggingface.api_endpoint and the file")


def _host_header(read_remote, host: str, path: str, key: str, cache, where):
    def produce(dest):
        if read_remote is None:
            raise GgufHeaderError(f"{host}:{path}: no connection to read it over")
        data = read_remote(host, path)
        if dest is None:
            fd, name = tempfile.mkstemp(prefix="meshdeploy-gguf-header-", suffix=".gguf")
            os.close(fd)
            dest = Path(name)
        dest.write_bytes(data)
        return dest
    return _kept(cache, key, produce, where, f"check the file on {host}")


def _on_host(cluster, model, facts: dict, host: str):
    """(content id, path to read) of a model that exists only on the hosts, or None.

    An Ollama blob is named by its sha256. A file given by path has no hash meshdeploy knows,
    so size and mtime name its content: a changed file is seeded again. Either way a worker whose
    bytes differ from the orchestrator's only misses the cache, never serves wrong data: entries
    are named by the hash of the bytes they hold.
    """
    src = model.source
    mine = facts.get(host) or {}
    if isinstance(src, OllamaSource):
        fact = mine.get(f"models.OllamaManifest[{model.name}]")
        if not fact:
            return None
        try:
            digest, blob = ollama_blob(fact)
        except ValueError:
            return None  # models.gguf reports the broken manifest
        return (digest.split(":", 1)[1], blob) if digest in fact["blobs"] else None
    fact = mine.get(f"models.ModelFile[{model.name}]")
    if not fact or fact.get("size") is None:
        return None
    return f"path-{fact['size']}-{fact['mtime']}", src.path


def _source(cluster, server, model, resolved, facts, names, fetch, cache, read_remote, cached):
    """(header or None, {host: content id}, note or None) of the model `server` loads."""
    where = f"models.{model.name}"
    src = model.source
    if isinstance(src, HfSource):
        if len(src.files) != 1:
            if cached:
                raise PlanError(f"{where}: rpc-server cache seeding (cache: true on a worker of "
                                f"servers.{server.name}) needs a one-file GGUF; this one is split",
                                hint="use a single-file GGUF of the model, or set cache: false")
            return None, {}, (f"servers.{server.name}: {model.name} is a split GGUF; its "
                              "placement is not computed")
        hf_model = resolved.value(MODELS, "models", {}).get(model.name)
        if hf_model is None:
            return None, {}, None  # no host in --limit loads it
        # The token only for a repo that needs it (models' hf.resolve checked its endpoint).
        token = resolved.value(MODELS, "hf_token") if hf_model.auth else None
        header = _hub_header(cluster, model, hf_model, token, fetch, cache, where)
        sha = hf_model.files[0].sha256
        return header, {h.name: sha for h in cluster.hosts}, None
    # Ollama store or a path: the bytes are only on the hosts. Read the header from a worker
    # that seeds (what it seeds from), else from the orchestrator.
    readers = [e.host.name for e in cluster.rpc_endpoints(server) if e.rpc.cache] + [server.host]
    ids = {}
    for host in dict.fromkeys(readers):
        found = _on_host(cluster, model, facts, host)
        if found is not None:
            ids[host] = found
    usable = [h for h in dict.fromkeys(readers) if h in ids and h in names]
    if not usable:
        return None, {}, (None if not cached else
                          f"servers.{server.name}: {model.name} is not on the probed hosts yet; "
                          "its placement and seeding are computed by the plan after it is")
    host = usable[0]
    content, path = ids[host]
    key = content if isinstance(src, OllamaSource) else \
        hashlib.sha256(f"{host}:{path}:{content}".encode()).hexdigest()
    header = _host_header(read_remote, host, path, key, cache, where)
    return header, {h: c for h, (c, _) in ids.items()}, None


@dataclass(frozen=True)
class SeedPlan:
    """What prepare() decides: the placement of every llama-server whose placement can be
    known, what each cached rpc-server should hold, and the plan's notes about placement."""

    seeds: dict  # "host:port" -> tuple[SeedModel, ...]
    layouts: tuple
    notes: tuple[str, ...]
    shared: dict  # model name -> ((offset, size), ...) of its hashed tensors, for digest lists
    splits: dict = field(default_factory=dict)  # server name -> placement: auto's -ts values
    # server name -> (the full failover.Run, then one per set of workers it may lose)
    runs: dict = field(default_factory=dict)
    # server name -> {"host:port": hashed bytes the other runs add to that cache}
    extra: dict = field(default_factory=dict)
    # "host:port" of a cached rpc-server in this run -> why its seeds stay as they are: a server
    # it serves splits by free memory and a worker of that server is not in this run (--limit).
    kept: dict = field(default_factory=dict)


def prepare(cluster, hosts, facts: dict, resolved, fetch=header_from_http,
            header_cache: Path | None = None, read_remote=None, speeds=None) -> SeedPlan:
    """The layouts, seeds and placement notes of the cluster (SeedPlan), from the probe's facts.

    Raises PlanError when a placement llama.cpp would refuse, or one that cannot fit, is asked for.
    + fetch: reads a Hub model's header over HTTP Range (tensors.header_from_http)
    + header_cache: a folder keeping headers by content id (the content they describe never
      changes), so a no-op plan reads no header again; None: no cache
    + read_remote(host, path) -> header bytes: reads the header of a model that is only on a
      host (Ollama store, path) over the plan's SSH connection; None: such models get no layout
    + speeds: server name -> its kept device speeds (engine.speeds), for placement: auto
    """
    speeds = speeds or {}
    names = {h.name for h in hosts}
    seeds: dict[str, list] = {}
    notes: list[str] = []
    layouts = []
    shared: dict[str, tuple] = {}
    runs: dict[str, tuple] = {}
    planned: list = []  # the servers inside --limit
    extra: dict[str, dict] = {s.name: {} for s in cluster.servers}
    kept: dict[str, str] = {}
    fetches = {(f.model, f.worker): f.source for f in distribution.tensor_fetches(cluster)}
    # What the placement weighs of the facts: each host's device memory.
    device_memory = {name: (f or {}).get(ops.DEVICE_MEMORY) for name, f in facts.items()}
    for server in cluster.servers:
        endpoints = cluster.rpc_endpoints(server)
        involved = {server.host} | {e.host.name for e in endpoints}
        if not involved & names:
            continue  # outside --limit
        planned.append(server)
        # Workers this run leaves out (--limit: away): services leaves the server's unit, its
        # placements and its failover as they are, so their unknown memory is no news.
        outside = sorted({e.host.name for e in endpoints} - names)
        away = outside if server.host in names else []
        if away:
            notes.append(f"servers.{server.name}: {', '.join(away)} not in this run (--limit): "
                         "the server's placements and failover are left as applied")
        cached = any(e.rpc.cache for e in endpoints)
        model = cluster.models[server.model]
        unknown = layout.unknown_memory(cluster, server, device_memory) \
            if server.tensor_split == "auto" else []
        unread = sorted({h.name for label, h, _, _ in cluster.server_devices(server)
                         if label in unknown})
        if unread and not set(unread) & names:
            # llama.cpp splits by every device's free memory, and only hosts outside this run
            # (--limit) were not read: which tensors the cached workers in the run hold is not
            # known, so their caches are left as seeded (never pruned to another share).
            for e in endpoints:
                if e.rpc.cache and e.host.name in names:
                    kept[rpc_ref(e.host.name, e.rpc.port)] = \
                        f"servers.{server.name} splits by free memory and " \
                        f"{', '.join(unread)} {'is' if len(unread) == 1 else 'are'} not in " \
                        "this run (--limit)"
            continue
        if unknown and not cached:
            notes.append(f"servers.{server.name}: free memory of {', '.join(unknown)} is "
                         "unknown, so llama.cpp's auto split cannot be predicted; placement "
                         "not checked" + _without_vulkaninfo(cluster, involved, facts))
            continue
        try:
            header, content, note = _source(cluster, server, model, resolved, facts, names, fetch,
                                             header_cache, read_remote, cached)
        except PlanError as exc:
            if cached:
                raise
            header, content, note = None, {}, f"servers.{server.name}: placement not checked: " \
                                              f"{exc.message}"
        if note:
            notes.append(note)
        if header is None:
            continue
        tensors = weight_tensors(header)
        lay = layout.build(cluster, server, tensors, model_shape(header), device_memory,
                           speeds.get(server.name), resolved.value(LLAMA_CPP, "commit"))
        layouts.append(lay)
        away_devices = {r["device"] for r in lay.rows if r["host"] in away}
        notes += layout.warnings(replace(lay, unknown=[d for d in lay.unknown
                                                       if d not in away_devices]))
        runs[server.name] = (failover.run_of(cluster, server, lay),) + tuple(failover.degraded(
            cluster, server, tensors, model_shape(header), device_memory, speeds.get(server.name),
            resolved.value(LLAMA_CPP, "commit")))
        if any(m == model.name for m, _ in fetches):
            shared[model.name] = tuple(sorted((t.offset, t.size) for t in tensors if t.hashed))
        seeded = [lay] + ([r.layout for r in runs[server.name][1:] if r.layout is not None]
                          if server.failover.seed else [])
        for i, each in enumerate(seeded):
            for row in each.rows:
                if not row["cached"] or row["host"] not in names or row["host"] not in content:
                    continue
                key = rpc_ref(row["host"], row["port"])
                source = fetches.get((model.name, row["host"]))
                seed = ops.SeedModel("" if source else model_path(cluster, model.name,
                                                                    cluster.host(row["host"])),
                                     content[row["host"]], tuple(row["tensors"]), model.name,
                                     source)
                before = _held(seeds.get(key, []))
                _merge(seeds.setdefault(key, []), seed)
                if i:  # what the placements without other workers add to this cache
                    extra[server.name][key] = extra[server.name].get(key, 0) + \
                        _held(seeds[key]) - before
    for server in planned:
        if server.name not in runs and cluster.supervised(server) and \
                not {e.host.name for e in cluster.rpc_endpoints(server)} - names:
            # services then writes the plain llama-server unit: say what that leaves out.
            notes.append(f"servers.{server.name}: no failover until a plan computes its "
                         "placements: llama-server runs unsupervised, and a lost worker stops "
                         "it")
    return SeedPlan({k: tuple(v) for k, v in seeds.items()}, tuple(layouts), tuple(notes),
                    shared, {lay.server: lay.split for lay in layouts if lay.split}, runs,
                    {s: {k: n for k, n in e.items() if n} for s, e in extra.items()}, kept)


def _without_vulkaninfo(cluster, hosts, facts: dict) -> str:
    """What the note adds where a vulkan host has no vulkaninfo yet: a new host gets it with the
    Vulkan packages of this apply, so only the plan after it can place by memory."""
    lacking = sorted(h for h in hosts if cluster.host(h).backend == "vulkan" and "vulkaninfo"
                     not in (((facts.get(h) or {}).get("toolchain.Platform") or {})
                             .get("tools") or ()))
    if not lacking:
        return ""
    return (f" (vulkaninfo is not on {', '.join(lacking)} yet: apply installs it with the Vulkan "
            "packages, and the plan after that apply reads the memory; apply again then)")


def _held(models: list) -> int:
    """Bytes of hashed tensors the seeds of one rpc-server hold."""
    return sum(t.size for m in models for t in m.tensors if t.hashed)


def _merge(merged: list, seed) -> None:
    """Adds `seed` to one rpc-server's seeds: one entry per model, its tensors united (an
    rpc-server may expose several devices, and serve several placements)."""
    for i, have in enumerate(merged):
        if have.model_sha == seed.model_sha:
            union = {t.offset: t for t in have.tensors + seed.tensors}
            merged[i] = replace(have, tensors=tuple(sorted(union.values(),
                                                           key=lambda t: t.offset)))
            return
    merged.append(seed)


def seed(ctx: HostContext, port: int) -> Step:
    """rpc_cache.seed[port] for this host, from what prepare() computed."""
    rpc = ctx.host.rpc_server(port)
    planned = run.of(ctx.resolved)
    ref = rpc_ref(ctx.host.name, port)
    if rpc is not None and rpc.cache and ref in planned.kept:
        return Step(ctx.change(ops.ROLE, f"seed[{port}]", "no-op",
                               f"left as seeded: {planned.kept[ref]}"))
    wanted = planned.seeds.get(ref) if rpc and rpc.cache else None
    if not wanted:
        if rpc is not None and rpc.cache:
            return Step(ctx.change(ops.ROLE, f"seed[{port}]", "no-op",
                                   "no llama-server loads through this rpc-server"))
        return ops.seed(ctx, port, "", [], d.cache_dir_for(ctx.host.layout, port), "-")
    first, *also = wanted
    return ops.seed(ctx, port, first.model_path, list(first.tensors),
                    d.cache_dir_for(ctx.host.layout, port),
                    first.model_sha, tuple(also), first.model, first.source)
