"""What earlier steps decided, for tests that plan one resource on its own."""

from __future__ import annotations

from meshdeploy.core.context import BuildOutcome, HostContext, Step


def decided(ctx: HostContext, build_key: str | None = None, build_changed: bool = False,
            restarted=()) -> HostContext:
    """Record in ctx.steps a llama_cpp.build step with this outcome (when build_key or
    build_changed is given) and rpc_server steps that (re)start the "host:port" in restarted."""
    if build_key is not None or build_changed:
        ctx.steps.add(ctx.host.name, "llama_cpp.build",
                      Step(ctx.change("llama_cpp", "build", "no-op"),
                           build=BuildOutcome(build_key, bool(build_changed))))
    for endpoint in restarted:
        host, _, port = endpoint.rpartition(":")
        ctx.steps.add(host, f"services.rpc_server[{port}]",
                      Step(ctx.change("services", f"rpc_server[{port}]", "update"),
                           restarts=(endpoint,)))
    return ctx
