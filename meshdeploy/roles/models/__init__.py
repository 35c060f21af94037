"""models: GGUF files from Hugging Face (or a mirror), an Ollama store, or a path."""

from meshdeploy.deploy.model import HfSource
from meshdeploy.deploy.registry import Prepare, Prepared, Resource, Role
from meshdeploy.roles.models import hf
from meshdeploy.roles.models import operations as ops


def _prepare(p: Prepare) -> Prepared:
    """Resolve every Hub model some planned host needs to one commit and its files' sha256."""
    resolved = {name: hf.resolve(p.cluster, model) for name, model in p.cluster.models.items()
                if isinstance(model.source, HfSource)
                and any(name in ops.needed(p.cluster, h) for h in p.hosts)}
    if not resolved:
        return Prepared()
    return Prepared(values={"models": resolved, "hf_token": hf.token(p.cluster)})


ROLE = Role(
    name="models",
    doc=__doc__,
    facts=lambda req: ops.sections(req.cluster, req.host),
    volatile=("models.DiskFree",),
    prepare=_prepare,
    after=("toolchain",),
    resources=(
        Resource("gguf", ops.gguf, "one model's GGUF, verified, where a host loads it",
                 keys=lambda cluster: list(cluster.models)),
    ),
)

gguf = ROLE.operation("gguf")
