"""network: each host's meshdeploy ports filtered to their peers (nftables `inet meshdeploy`)."""

from meshdeploy.deploy.registry import Prepared, Resource, Role
from meshdeploy.roles.network import operations as ops

ROLE = Role(
    name="network",
    doc=__doc__,
    facts=lambda req: ops.sections(req.cluster, req.host),
    preflight=ops.preflight,
    prepare=lambda p: Prepared(warnings=tuple(ops.warnings(p.cluster, p.facts))),
    after=("toolchain",),
    before=("services",),
    resources=(
        Resource("allowlist", lambda ctx, key: ops.allowlist(ctx),
                 "rpc-server ports open only to their orchestrators (nftables table)"),
    ),
)

allowlist = ROLE.operation("allowlist")
