"""rpc_cache.share: one host's verified copy of a model, served to the workers that fetch only
their tensors of it.

A worker with a seeded cache keeps no GGUF of a one-file Hub model it does not load itself
(config.distribution.tensor_fetches): the host of the model's first llama-server downloads it
once from the internet and verifies its sha256 (models.gguf), and this step, on that host,

- makes the model's digest list once from that verified file: "<gguf sha256> <offset> <size>
  <16hex fnv> <sha256>" per hashed tensor (md-rpc-seed --digest), beside the GGUF;
- when some worker misses tensors, starts md-share (meshdeploy.core.share): ranged GETs of the
  GGUF, bound to the host's cluster address, answering only the fetching hosts
  (network.allowlist opens its port to them alone), gone by itself once idle.

The workers' rpc_cache.seed re-reads the digest list (Resource.rereads) and fetches each missing
tensor's byte range into md-rpc-seed --receive, which puts an entry in place only when its size,
FNV-1a and sha256 are the list's: a worker never caches bytes that differ from the verified file.
"""

from __future__ import annotations

from meshdeploy.config.model import rpc_ref
from meshdeploy.config import distribution
from meshdeploy.core import inflight
from meshdeploy.core import share as md_share
from meshdeploy.core import shell
from meshdeploy.core.context import HostContext, Step
from meshdeploy.core.paths import model_path, model_share_port
from meshdeploy.core.plan import AttrDiff
from meshdeploy.roles.rpc_cache import operations as ops
from meshdeploy.roles.rpc_cache import run

ROLE = ops.ROLE
MODELS = "models"  # whose run values hold the models as the hub resolved them


def _digested(fact, model: str, sha: str, wanted) -> bool:
    """Whether the host's digest list of `model` covers every wanted (offset, size) and holds
    nothing else: a list with lines that are no digest records (the fact's "damaged" notes) is
    made again from the verified file."""
    if ((fact or {}).get(model) or {}).get("damaged"):
        return False
    have = ops.digest_index(fact, model, sha)
    return all(have.get(off, (None,))[0] == size for off, size in wanted)


def _to_serve(ctx: HostContext, model: str, workers) -> dict[str, int]:
    """worker -> bytes of `model` its caches still miss (from the workers' CacheDir facts)."""
    out = {}
    for worker in workers:
        missing = 0
        for port in sorted(r.port for r in worker.rpc_servers if r.cache):
            mine = [m for m in run.of(ctx.resolved).seeds.get(rpc_ref(worker.name, port), ())
                    if m.model == model and m.source == ctx.host.name]
            cov = ops.coverage(ctx.fact_of(worker.name, f"rpc_cache.CacheDir[{port}]"), mine)
            missing += sum(size for _, wanted in cov.to_seed for _, size in wanted)
        if missing:
            out[worker.name] = missing
    return out


def share(ctx: HostContext) -> Step:
    """rpc_cache.share: digest lists of the models this host's copy serves, and md-share while
    workers miss tensors.

    + facts: rpc_cache.Digests (this host), rpc_cache.CacheDir[port] (the fetching workers)
    Example: create "digest list of gemma; serve 1.20 GB to node2, node3 over the LAN"
    """
    cluster = ctx.cluster
    shares = distribution.shares(cluster, ctx.host)
    if not shares:
        return Step(ctx.change(ROLE, "share", "no-op", "no host fetches tensors from this host"))
    fact = ctx.fact("rpc_cache.Digests")
    digest, serve, diffs, listed = [], {}, [], 0
    for model, workers in shares.items():
        hub = ctx.resolved.value(MODELS, "models", {}).get(model)
        wanted = run.of(ctx.resolved).shared.get(model)
        if hub is None or wanted is None:
            continue  # outside --limit, or its header is unknown (the plan warned)
        sha = hub.files[0].sha256
        if not _digested(fact, model, sha, wanted):
            digest.append((model, sha, wanted))
            diffs.append(AttrDiff(f"digests[{model}]", None, f"{len(wanted)} tensors"))
        listed += len(wanted)
        for worker, size in _to_serve(ctx, model, workers).items():
            serve[worker] = serve.get(worker, 0) + size
    if not digest and not serve:
        return Step(ctx.change(ROLE, "share", "no-op",
                               f"digest lists of {', '.join(shares)} ({listed} tensors); "
                               "every fetching cache is seeded"))
    commands = [inflight.guarded(f"rpc_cache.share[{model}]",
                                 _digest_script(ctx, model, sha, wanted), ctx.host.layout)
                for model, sha, wanted in digest]
    reason = []
    if digest:
        reason.append(f"digest list of {', '.join(m for m, _, _ in digest)}")
    if serve:
        total = sum(serve.values())
        reason.append(f"serve {total / 1e9:.2f} GB to {', '.join(sorted(serve))} "
                      f"{md_share.way(cluster)} "
                      f"(md-share, port {model_share_port}, while this run lasts)")
        diffs.append(AttrDiff("md-share", None, f"{md_share.address(cluster, ctx.host.name)}:"
                                                f"{model_share_port}"))
        clients = [w for workers in shares.values() for w in workers]
        hub = ctx.resolved.value(MODELS, "models", {})
        files = {hub[m].files[0].sha256: model_path(cluster, m, ctx.host) for m in shares
                 if m in hub}
        commands += md_share.start(cluster, ctx.host, files, clients)
    return Step(ctx.change(ROLE, "share", "create" if digest else "update", "; ".join(reason),
                           diffs), commands)


def _digest_script(ctx: HostContext, model: str, sha: str, wanted) -> str:
    tag, listing = shell.heredoc("".join(f"{int(off)} {int(size)}\n" for off, size in wanted))
    return shell.script(f"{shell.body(ops.TEMPLATES / 'digest.sh')}\ndigest <<'{tag}'\n{listing}{tag}",
                        TOOL=ops.tool_path(ctx.prefix), GGUF=model_path(ctx.cluster, model, ctx.host),
                        OUT=ops.digests_path(ctx.cluster, model, ctx.host), SHA=ops.content_id(sha))
