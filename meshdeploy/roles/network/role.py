"""network: each host's meshdeploy ports filtered to their peers (nftables `inet meshdeploy`),
the WireGuard tunnel between orchestrators and workers (network.transport: wireguard), and the
keys of the ssh forwards (network.transport: ssh)."""

from meshdeploy.core.registry import Prepared, Resource, Role
from meshdeploy.roles.network import operations as ops
from meshdeploy.roles.network import ssh_ops

ROLE = Role(
    name="network",
    doc=__doc__,
    facts=lambda req: ops.sections(req.cluster, req.host, req.destroying),
    preflight=ops.preflight,
    destroy=ops.destroy,
    prepare=lambda p: Prepared(warnings=tuple(ops.warnings(p.cluster, p.facts)),
                               access=tuple(ops.access(p.cluster, p.hosts, p.facts))),
    after=("toolchain",),
    before=("services",),
    resources=(
        # Before llama_cpp.copy: a copier fetches from its builder's md-share through the
        # builder's allow-list, also a copier that joins an existing cluster.
        Resource("allowlist", lambda ctx, key: ops.allowlist(ctx),
                 "rpc-server ports open only to their orchestrators (nftables table)",
                 runs_before=("llama_cpp.copy",),
                 # Its rules come from the file and the plan's copiers, nftables through apt.
                 needs=("toolchain.apt_proxy",)),
        # wireguard-tools (and wireguard-go) come through apt: the proxy first. Before
        # llama_cpp.copy, as the tunnel is: a copier fetches its build through it.
        Resource("wireguard_key", lambda ctx, key: ops.wireguard_key(ctx),
                 "the host's WireGuard key pair, made on the host (network.transport)",
                 runs_before=("llama_cpp.copy",), needs=("toolchain.apt_proxy",)),
        # Its peers' public keys, and the allow-list that opens its UDP port to them: on every
        # host, as it is cluster-wide. Nothing of llama.cpp: a tunnel can come up before a build.
        Resource("wireguard", lambda ctx, key: ops.wireguard(ctx),
                 "the WireGuard tunnel to the host's RPC peers (wg-quick@, at boot)",
                 rereads=(("network.wireguard_key", "network.WireGuard"),),
                 cluster_wide=True, replaceable=True, runs_before=("llama_cpp.copy",),
                 needs=("toolchain.apt_proxy", "network.allowlist", "network.wireguard_key")),
        Resource("ssh_key", lambda ctx, key: ssh_ops.ssh_key(ctx),
                 "an orchestrator's key pair for its ssh forwards, made on the host "
                 "(network.transport: ssh)", replaceable=True),
        Resource("ssh_authorize", lambda ctx, key: ssh_ops.ssh_authorize(ctx),
                 "the orchestrators' forward keys in a worker's authorized_keys, each limited "
                 "to its forward",
                 rereads=(("network.ssh_key", "network.SshKey"),), cluster_wide=True),
        Resource("ssh_known_hosts", lambda ctx, key: ssh_ops.ssh_known_hosts(ctx),
                 "the workers' sshd host keys an orchestrator's forwards accept (pinned)",
                 cluster_wide=True),
        Resource("sshd_streamlocal", lambda ctx, key: ssh_ops.sshd_streamlocal(ctx),
                 "a root worker's sshd refuses Unix-socket forwards to the forwards' logins "
                 "(network.transport: ssh)", cluster_wide=True),
    ),
)
