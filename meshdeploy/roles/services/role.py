"""services: rpc-server and llama-server units (systemd, launchd), restarted when they change."""

from meshdeploy.config.model import LAUNCHD, RUNIT, SYSTEMD, SYSTEMD_USER
from meshdeploy.core import loading, shell
from meshdeploy.core.registry import Prepare, Prepared, Resource, Role, StatusProbe
from meshdeploy.roles.services import failover, forward, orchestrator
from meshdeploy.roles.services import operations as ops
from meshdeploy.roles.services.logs import log_sources
from meshdeploy.roles.services.rtt import network

# The plan's Hosts table: who supervises a rootless host's services.
_ROOTLESS_MANAGERS = {SYSTEMD_USER: "systemd --user", RUNIT: "runit (as the user)"}


def _manager_name(host, facts: dict) -> str:
    if host.rootless:
        return _ROOTLESS_MANAGERS.get(host.layout.manager, host.layout.manager)
    darwin = (facts.get(host.name, {}).get("toolchain.Platform") or {}).get("kernel") == "Darwin"
    return LAUNCHD if darwin else SYSTEMD


def _status(cluster, host) -> StatusProbe | None:
    """The forwards' rows and md-failover's: one probe, each line read by its own parser."""
    supervised = {s.name for s in cluster.servers if cluster.supervised(s)}
    probes = [p for p in (forward.status(cluster, host),
                          failover.status(cluster, host, supervised)) if p is not None]
    if len(probes) < 2:
        return probes[0] if probes else None
    return StatusProbe("\n".join(shell.subshell(p.script) for p in probes),
                       lambda lines: [row for p in probes for row in p.parse(lines)])


def _preflight(ctx) -> None:
    ops.preflight(ctx)
    forward.preflight(ctx)


def _prepare(p: Prepare) -> Prepared:
    return Prepared(warnings=tuple(loading.warnings(p.cluster)),
                    network=tuple(network(p.cluster, p.hosts, p.facts)),
                    access=tuple((h.name, "manager", _manager_name(h, p.facts))
                                 for h in p.hosts))


# A new build's manifest (binary names, flags) is read again before the units are written: one
# compiled here, or copied from the host that compiled it.
_MANIFEST = (("llama_cpp.build", "llama_cpp.Builds"), ("llama_cpp.copy", "llama_cpp.Builds"))

ROLE = Role(
    name="services",
    doc=__doc__,
    facts=lambda req: ops.sections(req.cluster, req.host),
    status=_status,
    volatile=("services.Rtt", "services.RpcClients"),
    prepare=_prepare,
    logs=log_sources,
    preflight=_preflight,
    destroy=ops.destroy,
    after=("llama_cpp", "models", "rpc_cache"),
    resources=(
        # Before the forwards (which run before any model byte moves): a forward whose worker
        # left the file holds the loopback port another forward moves to.
        Resource("cleanup", lambda ctx, key: ops.stale_units(ctx),
                 "meshdeploy units the cluster file no longer describes",
                 runs_before=("models.gguf",)),
        Resource("rpc_server", ops.rpc_server, "one rpc-server, proven listening",
                 keys=lambda cluster: cluster.rpc_ports(), rereads=_MANIFEST, together=True),
        # Right after the network role's keys and pins, before any model byte moves: the
        # forward's reverse ends carry md-share's copies and tensors to the workers
        # (models.gguf, rpc_cache.seed), and the llama-servers dial its local ends.
        Resource("ssh_forward", forward.ssh_forward,
                 "network.transport: ssh: one orchestrator's forward to a worker, accepting",
                 keys=forward.keys, cluster_wide=True, runs_before=("models.gguf",)),
        Resource("llama_server", orchestrator.llama_server,
                 "the orchestrator, restarted after its workers, then healthy",
                 keys=lambda cluster: [s.name for s in cluster.servers], rereads=_MANIFEST,
                 together=True),
    ),
)
