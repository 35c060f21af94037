"""rpc_cache: rpc-server caches filled from the worker's own GGUF, so no weight crosses the wire.

rpc-server -c looks up each >10 MiB weight by the FNV-1a hash of its bytes; md-rpc-seed (built
on the worker from templates/md-rpc-seed.c) writes those entries atomically. Hashes exist only
after hashing on the worker, so a marker in the cache dir records what was seeded:
"<gguf sha256> <offset> <size> <16hex>" per tensor. A later plan trusts the marker when every
wanted (offset, size) of the model is listed and each listed entry exists with its size.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from meshdeploy.config.model import rpc_unit_name
from meshdeploy.config import distribution
from meshdeploy.core import inflight, progress, share, shell, transient
from meshdeploy.core.context import HostContext, Step, Transfer, stored_teardown
from meshdeploy.core.paths import model_path
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.probe import Section
from meshdeploy.errors import PlanError
from meshdeploy.roles.rpc_cache import defaults as d
from meshdeploy.roles.rpc_cache.facts import (
    CacheDir,
    CacheFree,
    DeviceMemory,
    Digests,
    SeedTool,
    Stored,
)
from meshdeploy.placement.layers import wire_bytes
from meshdeploy.placement.tensors import Tensor

ROLE = "rpc_cache"
DEVICE_MEMORY = f"{ROLE}.DeviceMemory"  # the fact the placement weighs (seeding.prepare)
TEMPLATES = Path(__file__).with_name("templates")
SOURCE = TEMPLATES / "md-rpc-seed.c"
_HEX16_GLOB = "[0-9a-f]" * 16
# A model's content id goes into the marker file and md-rpc-seed's answers (awk -v): a sha256,
# or "path-<size>-<mtime>".
_CONTENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# GPU backends whose device nodes only root or the render group may open (vulkaninfo and
# rocm-smi see no device as an ordinary login user).
_PRIVILEGED_MEMORY = ("vulkan", "rocm")


@dataclass(frozen=True)
class SeedModel:
    """One model whose tensors a worker's cache should hold."""

    model_path: str  # the GGUF on the worker ("" when its tensors are fetched)
    model_sha: str  # its sha256 (any stable content id without spaces)
    tensors: tuple[Tensor, ...]  # what llama-server sends to this worker (placement.device_tensors)
    model: str = ""  # the model's name in the cluster file
    source: str | None = None  # the host whose copy the tensors are fetched from; None: local


def tool_path(prefix: str) -> str:
    return f"{prefix}/{d.rpc_cache_tools_dir}/{d.rpc_cache_tool_name}"


def source_sha256() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()


def _cached_ports(host) -> list[int]:
    return sorted(r.port for r in host.rpc_servers if r.cache)


def _in_server(cluster, host) -> bool:
    """Whether some llama-server counts this host's devices (its placement needs their memory)."""
    for server in cluster.servers:
        if server.host == host.name or \
                any(e.host.name == host.name for e in cluster.rpc_endpoints(server)):
            return True
    return False


def digests_path(cluster, model: str, host) -> str:
    """The digest list beside a shared model's GGUF (on `host`, which shares it)."""
    return model_path(cluster, model, host) + d.rpc_cache_digests_suffix


def sections(cluster, host) -> list[Section]:
    """Probe sections: device memory (for the split), the tool, each cached cache dir, the
    digest lists of the models this host shares."""
    out = [Section(DEVICE_MEMORY, DeviceMemory,
                   privileged=host.backend in _PRIVILEGED_MEMORY)] \
        if _in_server(cluster, host) else []
    if distribution.seeds(cluster, host):
        out.append(Section("rpc_cache.SeedTool", SeedTool,
                           {"path": tool_path(host.layout.prefix)}))
    shared = distribution.shares(cluster, host)
    if shared:
        out.append(Section("rpc_cache.Digests", Digests,
                           {"paths": {m: digests_path(cluster, m, host) for m in shared}}))
    ports = _cached_ports(host)
    if not ports:
        return out
    out.append(Section("rpc_cache.CacheFree", CacheFree, {"path": host.layout.cache}))
    # A DynamicUser's CacheDirectory lives under /var/cache/private (0700 root): only root reads
    # it. A rootless host's is the login user's own, read as that user.
    if host.layout.rootless:
        return out + [Section(f"rpc_cache.CacheDir[{p}]", CacheDir,
                              {"path": d.cache_dir_for(host.layout, p), "as_user": True})
                      for p in ports]
    out += [Section(f"rpc_cache.CacheDir[{p}]", CacheDir, {"path": d.cache_dir_for(host.layout, p)},
                    privileged=True)
            for p in ports]
    return out


def seed_tool(ctx: HostContext) -> Step:
    """rpc_cache.seed_tool: md-rpc-seed compiled on the host from the shipped source (cached
    workers seed with it; a host whose copy others fetch from makes digest lists with it).

    + facts: rpc_cache.SeedTool (the source sha256 the installed binary was built from)
    Example: no-op "md-rpc-seed built from source 3f2a9c01b7de"
    """
    if not distribution.seeds(ctx.cluster, ctx.host):
        return Step(ctx.change(ROLE, "seed_tool", "no-op",
                               "no cached rpc-server or shared model on this host"))
    want = source_sha256()
    have = ctx.fact("rpc_cache.SeedTool")
    if have and have.get("source_sha256") == want:
        return Step(ctx.change(ROLE, "seed_tool", "no-op", f"md-rpc-seed built from source {want[:12]}"))
    binary = tool_path(ctx.prefix)
    src = f"{binary}.c"  # kept beside the binary; destroy --purge removes it (destroy_sections)
    stamp = f"{binary}{d.rpc_cache_tool_source_suffix}"
    build = shell.template(TEMPLATES / "build-tool.sh", HOST=ctx.host.name, CC=d.rpc_cache_tool_cc, BIN=binary,
                         SRC=src, SHA=want, STAMP=stamp)
    before = None if have is None else ((have.get("source_sha256") or "unknown")[:12])
    return Step(ctx.change(ROLE, "seed_tool", "create" if have is None else "update",
                           "build md-rpc-seed" if have is None else "source changed; rebuild",
                           [AttrDiff("source_sha256", before, want[:12])]),
                [shell.write_file(src, SOURCE.read_text()), build])


@dataclass
class Coverage:
    """What a cache dir holds of the models it should hold (from its CacheDir fact)."""

    keep_lines: list  # marker lines (sha, offset, size, name) whose entries are in place
    to_seed: list  # (SeedModel, [(offset, size), ...]) still missing
    stale: list  # entry names no wanted model's marker line names
    temporary: list  # leftovers of interrupted writes
    marker_now: list  # the marker as it is
    # What the rpc-server's user may have left: lines of the marker no seeding wrote (the fact's
    # notes), or a link where the folder belongs; either makes the step rewrite the folder.
    damaged: list = field(default_factory=list)
    link: bool = False

    @property
    def done(self) -> bool:
        return not self.to_seed and not self.stale and not self.temporary \
            and not self.damaged and not self.link \
            and self.marker_now == sorted(set(self.keep_lines))


def coverage(fact: dict | None, models) -> Coverage:
    """Compare a cache dir (CacheDir fact) with the SeedModels it should hold."""
    entries = (fact or {}).get("entries", {})
    marker = (fact or {}).get("marker", [])
    keep_lines, to_seed, referenced, claimed = [], [], set(), set()
    for m in models:
        wanted = {(t.offset, t.size) for t in m.tensors if t.hashed}
        covered = {}
        for sha, off, size, name in marker:
            if sha == m.model_sha and (off, size) in wanted:
                claimed.add(name)  # a wrong-size entry is replaced by seeding, not deleted
                if entries.get(name) == size:
                    covered[(off, size)] = name
        keep_lines += [(m.model_sha, off, size, name) for (off, size), name in sorted(covered.items())]
        referenced |= set(covered.values())
        missing = sorted(wanted - covered.keys())
        if missing:
            to_seed.append((m, missing))
    stale = sorted(n for n in entries if n not in referenced and n not in claimed)
    return Coverage(keep_lines, to_seed, stale, (fact or {}).get("temporary", []),
                    sorted(set(marker)), list((fact or {}).get("damaged", [])),
                    bool((fact or {}).get("link")))


def digest_index(fact: dict | None, model: str, model_sha: str) -> dict:
    """offset -> (size, fnv16, sha256) from a sharing host's Digests fact."""
    lines = ((fact or {}).get(model) or {}).get(model_sha) or []
    return {off: (size, fnv, sha) for off, size, fnv, sha in lines}


def seed(ctx: HostContext, port: int, model_path: str, tensors: list[Tensor], cache_dir: str,
         model_sha: str, also: tuple[SeedModel, ...] = (), model: str = "",
         source: str | None = None) -> Step:
    """rpc_cache.seed[port]: the worker's rpc-server cache holds every >10 MiB tensor it loads.

    + model_path, model_sha: the GGUF on this worker and its sha256
    + tensors: what llama-server sends to this rpc-server (placement.device_tensors)
    + cache_dir: rpc-server's $LLAMA_CACHE/rpc (defaults.cache_dir_for(layout, port)), seeded
      as the rpc-server's user (as_service_user), on a rootless host as the login user
      (as_login_user)
    + also: further models served through the same rpc-server; their entries are kept too
    + model, source: the model's name and, when this worker keeps no GGUF of it, the host whose
      verified copy its tensors are fetched from (ranged GETs to md-share, each tensor checked
      against that host's digest list before it is put in place)
    Entries in the cache dir that no wanted model's marker line names are deleted.
    Example: create "1.95 GB to seed from /opt/meshdeploy/models/m/m.gguf; 90.2 MB of small
             tensors still cross the network at each load"
    """
    resource = f"seed[{port}]"
    rpc = ctx.host.rpc_server(port)
    if rpc is None:
        return Step(ctx.change(ROLE, resource, "no-op", "no rpc-server on this port here"))
    if not rpc.cache:
        return Step(ctx.change(ROLE, resource, "no-op", "cache off for this rpc-server"))
    models = (SeedModel(model_path, model_sha, tuple(tensors), model, source),) + tuple(also)
    for m in models:
        if not m.model_sha or any(c.isspace() for c in m.model_sha):
            raise PlanError(f"rpc_cache.seed[{port}] on {ctx.host.name}: model sha {m.model_sha!r} "
                            "is empty or has spaces", hint="pass the GGUF's sha256")
    fact = ctx.fact(f"rpc_cache.CacheDir[{port}]")
    cov = coverage(fact, models)
    if cov.done:
        n = len(cov.keep_lines)
        size = sum(line[2] for line in cov.keep_lines)
        return Step(ctx.change(ROLE, resource, "no-op",
                               f"{n} tensors ({size / 1e9:.2f} GB) seeded for {model_sha[:12]}"))
    entries = (fact or {}).get("entries", {})
    seed_bytes = sum(size for _, missing in cov.to_seed for _, size in missing)
    fetched = sum(size for m, missing in cov.to_seed if m.source for _, size in missing)
    small = sum(wire_bytes(list(m.tensors))[1] for m in models)
    diffs = []
    if cov.to_seed:
        count = sum(len(missing) for _, missing in cov.to_seed)
        diffs.append(AttrDiff("seeded", f"{len(cov.keep_lines)} tensors",
                              f"{len(cov.keep_lines) + count} tensors (+{seed_bytes / 1e6:.1f} MB)"))
    if cov.stale:
        stale_bytes = sum(entries[n] for n in cov.stale)
        diffs.append(AttrDiff("stale entries", f"{len(cov.stale)} ({stale_bytes / 1e6:.1f} MB)", None))
    if cov.temporary:
        diffs.append(AttrDiff("interrupted writes", " ".join(cov.temporary), None))
    if cov.link:
        diffs.append(AttrDiff("cache folder", "a symbolic link (never followed)", "a folder"))
    if cov.damaged:
        diffs.append(AttrDiff("marker", "damaged: " + "; ".join(cov.damaged), "rewritten"))
    if cov.to_seed:
        action = "create" if not cov.keep_lines else "update"
        where = ", ".join(sorted({f"{share.way(ctx.cluster)} from {m.source}" if m.source else
                                  f"from {m.model_path}" for m, _ in cov.to_seed}))
        reason = (f"{seed_bytes / 1e9:.2f} GB to seed {where}; {small / 1e6:.1f} MB of "
                  "small tensors still cross the network at each load")
    else:
        action = "delete" if cov.stale else "update"
        reason = "remove what no deployed model uses" if cov.stale else "rewrite the seeding marker"
    free = ctx.fact("rpc_cache.CacheFree")
    if free is not None and seed_bytes and seed_bytes + d.rpc_cache_disk_headroom_bytes > free:
        raise PlanError(f"host {ctx.host.name}: rpc_cache.seed[{port}] needs "
                        f"{seed_bytes / 2**30:.2f} GiB more under {ctx.host.layout.cache}, only "
                        f"{free / 2**30:.2f} GiB free", hint="free disk space there, or set "
                        "cache: false on this rpc-server")
    transfer = Transfer(lan_bytes=fetched, disk_bytes=seed_bytes, disk_free=free) \
        if seed_bytes else None
    change = ctx.change(ROLE, resource, action, reason, diffs)
    fetches = []
    for m, missing in cov.to_seed:
        if not m.source:
            continue
        digests = digest_index(ctx.fact_of(m.source, "rpc_cache.Digests"), m.model, m.model_sha)
        if any(off not in digests or digests[off][0] != size for off, size in missing):
            if ctx.cluster_facts is not None and m.source not in ctx.cluster_facts:
                raise PlanError(f"rpc_cache.seed[{port}] on {ctx.host.name}: its tensors of "
                                f"{m.model} come from {m.source}'s copy, and {m.source} is "
                                "outside --limit", hint=f"add {m.source} to --limit")
            if ctx.run_command is not None:  # apply: the sharing host's step ran before this one
                raise PlanError(f"rpc_cache.seed[{port}] on {ctx.host.name}: {m.source} has no "
                                f"digest list of {m.model} for these tensors (its "
                                "rpc_cache.share step failed or did not run)",
                                hint="run apply again; the plan shows what the share step does")
            change.reason += f" (tensor digests known after apply on {m.source})"
            return Step(change, transfer=transfer)
        fetches.append((m, share.url(ctx.cluster, m.source, m.model_sha, ctx.host.name),
                        [(off, size) + digests[off][1:] for off, size in missing]))
    script = _seed_script(tool_path(ctx.prefix), cache_dir, sorted(set(cov.keep_lines)),
                          [t for t in cov.to_seed if not t[0].source], fetches)
    if ctx.host.layout.rootless:
        seeding = as_login_user(cache_dir.rsplit("/", 1)[0], script)  # $LLAMA_CACHE of rpc/
    else:
        seeding = as_service_user(port, script, [share.address(ctx.cluster, m.source)
                                                 for m, _, _ in fetches])
    return Step(change, [inflight.guarded(f"rpc_cache.seed[{port}]", seeding, ctx.host.layout)],
                transfer=transfer)


def content_id(model_sha: str) -> str:
    if not isinstance(model_sha, str) or not _CONTENT_ID.fullmatch(model_sha):
        raise PlanError(f"model content id {model_sha!r} is not a plain word (a sha256)",
                        hint="report this: meshdeploy names seeded models by their sha256")
    return model_sha


def _seed_script(tool: str, cache_dir: str, keep_lines: list, to_seed: list,
                 fetches=()) -> str:
    """Seed, then write the marker, then delete entries it does not name, in that order: an
    entry rpc-server wrote itself for a wanted tensor is kept by md-rpc-seed, not rewritten.
    fetches: (SeedModel, url, [(offset, size, fnv16, sha256), ...]) fetched from m.source."""
    lines = []
    if keep_lines:
        tag, body = shell.heredoc("".join(f"{content_id(sha)} {int(off)} {int(size)} {name}\n"
                                          for sha, off, size, name in keep_lines))
        lines.append(f"cat >> \"$MT\" <<'{tag}'\n{body}{tag}")
    for m, missing in to_seed:
        tag, listing = shell.heredoc("".join(f"{int(off)} {int(size)}\n" for off, size in missing))
        lines.append(shell.command("seed_one", tool, m.model_path, content_id(m.model_sha))
                     + f" <<'{tag}'\n{listing}{tag}")
    for m, url, missing in fetches:
        tag, listing = shell.heredoc("".join(f"{int(off)} {int(size)} {_hex(fnv, 16)} "
                                             f"{_hex(sha, 64)}\n"
                                             for off, size, fnv, sha in missing))
        lines.append(shell.command("fetch_one", url, content_id(m.model_sha), m.model)
                     + f" <<'{tag}'\n{listing}{tag}")
    fetching = {"TOOL": tool, "ATTEMPTS": int(d.rpc_cache_fetch_attempts),
                "LANES": int(d.rpc_cache_fetch_lanes)} if fetches else {}
    body = "\n".join([shell.body(TEMPLATES / "seed.sh"), *lines, "seed_finish"])
    return shell.script(body, prelude=progress.SHELL, D=cache_dir,
                        M=f"{cache_dir}/{d.rpc_cache_marker}", HEX16=_HEX16_GLOB, **fetching)


RUNDIR = "/run/meshdeploy/seed"  # the seed scripts, root's


def seed_properties(port: int, sources=()) -> list[str]:
    """The seed unit's settings: rpc-server[port]'s DynamicUser and CacheDirectory (units that
    name one dynamic user share its UID), transient.SANDBOX, and the network: only the addresses
    it fetches from (`sources`), none when it seeds from a local GGUF. A source that is not an
    IP literal leaves the addresses open (IPAddressAllow= takes no names)."""
    unit = rpc_unit_name(port)
    ips = []
    for address in sources:
        try:
            ips.append(str(ipaddress.ip_address(address)))
        except ValueError:
            ips = None
            break
    network = [] if ips is None else ["IPAddressDeny=any"]
    if ips:
        network.append("IPAddressAllow=" + " ".join(sorted(set(ips))))
    # The sandbox is the rpc-server's own and more: a taken-over rpc-server, which shares the
    # user, gains nothing by reaching into this unit.
    return ["DynamicUser=yes", f"User={unit}", f"Group={unit}", f"CacheDirectory={unit}",
            *transient.SANDBOX, *network]


def as_service_user(port: int, seed_script: str, sources=()) -> str:
    """`seed_script` run as rpc-server[port]'s own user (templates/seed-as-service.sh): a
    transient unit sharing its DynamicUser and CacheDirectory on systemd hosts
    (transient.BOOTED exists), reaching only `sources`; as it is elsewhere, where the script refuses a folder its
    user does not own."""
    props = [w for p in seed_properties(port, sources) for w in ("-p", p)]
    return shell.assign_text("SEED", seed_script) + "\n" + shell.template(
        TEMPLATES / "seed-as-service.sh", args=props, prelude=shell.SYSTEMD_RUN,
        UNIT=rpc_unit_name(port), BOOTED=transient.BOOTED, RUNDIR=RUNDIR)


def as_login_user(cache: str, seed_script: str) -> str:
    """`seed_script` run on a rootless host as its login user, the rpc-server's own
    (templates/seed-as-user.sh): no unit, in the step's process group; `cache` (the
    rpc-server's LLAMA_CACHE) made the user's alone, a link there replaced by a folder."""
    return shell.assign_text("SEED", seed_script) + "\n" + shell.template(
        TEMPLATES / "seed-as-user.sh", CACHE=cache)


_HEX = re.compile(r"[0-9a-f]+")


def _hex(value: str, length: int) -> str:
    """A digest as the digest list holds it (lower-case hex of `length`); anything else is
    refused before it reaches a command."""
    if not isinstance(value, str) or len(value) != length or not _HEX.fullmatch(value):
        raise PlanError(f"digest {value!r} is not {length} lower-case hex digits",
                        hint="the host's digest list is damaged: delete it and apply again")
    return value


def destroy(ctx: HostContext, purge: bool):
    """rpc-server caches and the seeding tool; only with purge (a cache saves a model's upload
    over the network at every start)."""
    stored = ctx.fact("rpc_cache.Stored") or {}
    caches = sorted({p.rsplit("/", 1)[-1] for p in stored if _CACHE in p})
    what = ", ".join(([f"rpc-server caches {', '.join(caches)}"] if caches else [])
                     + (["md-rpc-seed"] if any(_CACHE not in p for p in stored) else []))
    tools = f"{ctx.prefix}/{d.rpc_cache_tools_dir}"
    return stored_teardown(ctx, ROLE, "seed", stored, what, purge,
                           (shell.command("rmdir", tools, shell.QUIET, shell.OR, "true"),))


_CACHE = rpc_unit_name(0).rsplit("-", 1)[0]  # "meshdeploy-rpc": every port's cache folder


def destroy_sections(cluster, host) -> list[Section]:
    tool = tool_path(host.layout.prefix)
    cache = host.layout.cache
    # A DynamicUser's CacheDirectory lives under <cache>/private on a host with root.
    folders = [cache] if host.layout.rootless else [cache, f"{cache}/private"]
    # md-share's log on a rootless host is the user's file in its cache folder (on a host with
    # root it is the system's log, under /var/log).
    logs = [share.paths(host.layout)["LOG"]] if host.layout.rootless else []
    return [Section("rpc_cache.Stored", Stored,
                    {"paths": [tool, f"{tool}.c", tool + d.rpc_cache_tool_source_suffix,
                               share.server_path(host.layout.prefix), *logs],
                     "folders": folders, "prefix": _CACHE + "-"},
                    privileged=not host.layout.rootless)]
