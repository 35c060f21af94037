"""rpc_cache: rpc-server caches seeded with what each worker's placement holds."""

from meshdeploy.core.registry import Prepare, Prepared, Resource, Role
from meshdeploy.placement import layout
from meshdeploy.placement.tensors import GgufHeaderError, header_bytes
from meshdeploy.roles.rpc_cache import operations as ops
from meshdeploy.roles.rpc_cache import run, seeding, sharing


def _prepare(p: Prepare) -> Prepared:
    def read(host, path):
        try:
            return p.read_remote(host, path, header_bytes)
        except ValueError as exc:  # the session's read errors and the header's own
            raise GgufHeaderError(str(exc)) from None

    planned = seeding.prepare(p.cluster, p.hosts, p.facts, p.resolved, header_cache=p.header_cache,
                              read_remote=read if p.read_remote is not None else None,
                              speeds=p.speeds)
    return Prepared(values=run.Run(seeds=planned.seeds, layouts=planned.layouts,
                                   shared=planned.shared, splits=planned.splits,
                                   failover=planned.runs, kept=planned.kept),
                    warnings=planned.notes,
                    placement=layout.sections(planned.layouts, p.cluster, planned.runs,
                                              planned.extra))


ROLE = Role(
    name="rpc_cache",
    doc=__doc__,
    facts=lambda req: ops.sections(req.cluster, req.host)
    + (ops.destroy_sections(req.cluster, req.host) if req.destroying else []),
    destroy=ops.destroy,
    volatile=(ops.DEVICE_MEMORY, "rpc_cache.CacheFree"),
    prepare=_prepare,
    after=("models",),
    resources=(
        Resource("seed_tool", lambda ctx, key: ops.seed_tool(ctx),
                 "md-rpc-seed, compiled on the worker from the shipped source"),
        Resource("share", lambda ctx, key: sharing.share(ctx),
                 "digest lists of models fetched from this host's copy; md-share while needed",
                 cluster_wide=True),
        Resource("seed", seeding.seed, "a cached rpc-server's entries for what its placement holds",
                 keys=lambda cluster: cluster.rpc_ports(), cluster_wide=True,
                 rereads=(("rpc_cache.share", "rpc_cache.Digests"),)),
    ),
)
