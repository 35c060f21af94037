"""llama_cpp: one commit everywhere (lock file), the clone, and builds compiled once per build
key and copied to the key's other hosts (keys.py)."""

from meshdeploy.core import registry
from meshdeploy.core.registry import FactRequest, Prepare, Prepared, Resource, Role
from meshdeploy.roles.llama_cpp import consistency, copies, keys, lock, run, settings
from meshdeploy.roles.llama_cpp import operations as ops


def _facts(req: FactRequest):
    return ops.sections(req.cluster, req.host, lock.known_commit(req.cluster), req.first) + (
        ops.destroy_sections(req.cluster, req.host) if req.destroying else [])


def _prepare(p: Prepare) -> Prepared:
    first = registry.resolver(p.hosts)
    upstream = (p.facts.get(first) or {}).get("llama_cpp.RemoteRef") if first else None
    commit, how = lock.resolve(p.cluster, upstream, first)
    if upstream == ops.RemoteRef.MISSING:
        upstream = None
    return Prepared(values=run.Run(commit=commit, commit_source=how, upstream_commit=upstream,
                                   build_number=lock.build_number(settings.of(p.cluster).ref),
                                   build_copiers=keys.copiers(p.cluster, p.hosts, p.facts, commit,
                                                              p.resolved.replace)),
                    commit=(commit, how),
                    warnings=tuple(lock.moved_warning(p.cluster, upstream)))


ROLE = Role(
    name="llama_cpp",
    doc=__doc__,
    facts=_facts,
    prepare=_prepare,
    check=consistency.check,
    destroy=ops.destroy,
    preflight=ops.preflight,
    inputs=lambda cluster: [lock.lock_path(cluster.path)],
    apply_started=lambda cluster, resolved: lock.record(cluster, run.of(resolved).commit,
                                                        run.of(resolved).commit_source),
    after=("toolchain",),
    resources=(
        Resource("resolve", lambda ctx, key: ops.resolve(ctx),
                 "the ref resolved on the first host when the plan could not", apply_only=True),
        Resource("source", lambda ctx, key: ops.source(ctx),
                 "the clone at the pinned commit"),
        Resource("build", lambda ctx, key: ops.build(ctx),
                 "llama-server and the RPC worker, compiled once per build key",
                 serial=lambda cluster: settings.of(cluster).build.serial, replaceable=True),
        # After the host's own build: builds for hosts of another architecture (keys.py).
        Resource("cross", lambda ctx, key: ops.cross(ctx),
                 "builds this host cross-compiles for hosts of another architecture",
                 replaceable=True),
        # After every host's build: the build it copies is finished (keys.py says who copies).
        Resource("copy", lambda ctx, key: copies.copy(ctx),
                 "a build another host of its build key compiled, copied and verified",
                 # The builder's new tarball and its sha256, which the copy is checked against.
                 rereads=(("llama_cpp.build", "llama_cpp.Builds"),
                          ("llama_cpp.cross", "llama_cpp.Builds")), rereads_peers=True),
    ),
)
