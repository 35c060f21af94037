"""models: GGUF files from Hugging Face (or a mirror), an Ollama store, or a path."""

from concurrent.futures import ThreadPoolExecutor

from meshdeploy.config.sources import HfSource
from meshdeploy.config import distribution
from meshdeploy.core.registry import Prepare, Prepared, Resource, Role
from meshdeploy.roles.models import hf, run
from meshdeploy.roles.models import operations as ops


def _prepare(p: Prepare) -> Prepared:
    """Resolve every Hub model some planned host needs (or fetches tensors of) to one commit
    and its files' sha256; the token is read (once) only when one of them is gated or private."""
    read = []

    def get_token(cluster):
        if not read:
            read.append(hf.token(cluster))
        return read[0]

    wanted = [(name, model) for name, model in p.cluster.models.items()
              if isinstance(model.source, HfSource)
              and any(name in ops.needed(p.cluster, h)
                      or name in distribution.fetched_models(p.cluster, h) for h in p.hosts)]
    # One request per model, at once (each is a round trip to the Hub); a failure is raised
    # for the first model in file order that failed, as in turn.
    with ThreadPoolExecutor(max_workers=max(1, min(len(wanted), 8))) as pool:
        futures = [(name, pool.submit(hf.resolve, p.cluster, model, get_token))
                   for name, model in wanted]
        resolved = {name: future.result() for name, future in futures}
    if not resolved:
        return Prepared()
    needed = any(r.auth for r in resolved.values())
    return Prepared(values=run.Run(models=resolved,
                                   hf_token=get_token(p.cluster) if needed else None))


def _holders(cluster, name: str) -> list[str]:
    """The hosts whose models.gguf[name] does something: those keeping the model's GGUF (its
    source among them)."""
    return [h.name for h in cluster.hosts if name in ops.needed(cluster, h)]


ROLE = Role(
    name="models",
    doc=__doc__,
    facts=lambda req: ops.sections(req.cluster, req.host)
    + (ops.destroy_sections(req.cluster, req.host) if req.destroying else []),
    destroy=ops.destroy,
    volatile=("models.DiskFree",),
    prepare=_prepare,
    # After network: a copy from another host travels through its allow-list and tunnel.
    after=("toolchain", "network"),
    resources=(
        # A host that copies model M runs its models.gguf[M] while M's source runs its own:
        # models whose hosts do not meet download at once, the others in turn.
        Resource("gguf", ops.gguf, "one model's GGUF, verified, where a host loads it",
                 keys=lambda cluster: list(cluster.models), cluster_wide=True,
                 together=_holders),
    ),
)
