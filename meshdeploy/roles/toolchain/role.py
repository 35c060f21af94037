"""toolchain: build tools (cmake, compiler, git, curl, ninja, ccache), or what a host that copies
its llama.cpp build needs, and the apt proxy."""

from meshdeploy.core.registry import Resource, Role
from meshdeploy.roles.toolchain import operations as ops

ROLE = Role(
    name="toolchain",
    doc=__doc__,
    facts=lambda req: ops.sections(req.cluster, req.host),
    preflight=ops.preflight,
    destroy=ops.destroy,
    resources=(
        Resource("apt_proxy", lambda ctx, key: ops.apt_proxy(ctx),
                 "the apt proxy from the cluster file, or none", needs=()),
        Resource("packages", lambda ctx, key: ops.packages(ctx),
                 "the packages that build llama.cpp and md-rpc-seed, or that a copier needs",
                 needs=("toolchain.apt_proxy",)),
    ),
)
