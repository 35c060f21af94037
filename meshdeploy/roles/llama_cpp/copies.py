"""llama_cpp.copy: a build another host of its build key compiled (keys.py says who), fetched
from that builder's md-share, checked against the sha256 the builder computed and unpacked
beside this host's other builds; and the builder's part of the same slot, serving its tarballs
(its own build's and those it cross-compiled) while the run lasts."""

from __future__ import annotations

from dataclasses import replace

from meshdeploy.core import progress, share, shell
from meshdeploy.core.context import BuildOutcome, HostContext, Step
from meshdeploy.core.paths import installed_build
from meshdeploy.core.plan import AttrDiff
from meshdeploy.errors import ApplyError
from meshdeploy.roles.llama_cpp import defaults as d
from meshdeploy.roles.llama_cpp import keys, run
from meshdeploy.roles.llama_cpp.keys import targets
from meshdeploy.roles.llama_cpp.lock import checked_commit
from meshdeploy.roles.llama_cpp.operations import (
    ROLE,
    TEMPLATES,
    activate_script,
    archive,
    archive_of,
    lacking_hosts,
    pack_script,
)


def copy(ctx: HostContext) -> Step:
    """llama_cpp.copy: a build compiled on another host of the same build key, copied here.

    On a copying host: the builder's tarball fetched from its md-share, its sha256 checked
    against the one the builder computed, unpacked beside the other builds, its binaries run
    here, then `current` flipped (activate.sh). On the builder: the tarball packed once and
    md-share started for the hosts that still lack the build. Runs after every host's
    llama_cpp.build, so the build it copies is finished.
    """
    cluster, host = ctx.cluster, ctx.host
    if not targets(cluster, host):
        return Step(ctx.change(ROLE, "copy", "no-op", "nothing to copy"))
    decision = keys.decide(ctx)
    crossed = keys.cross_builds(ctx)
    if decision.builder == host.name:
        return _serve(ctx, [decision, *crossed])
    step = _copy(ctx, decision)
    # A cross builder copying its own build (-replace made another host its builder) serves
    # the builds it cross-compiled all the same.
    return _and_serve(ctx, step, _serve(ctx, crossed)) if crossed else step


def _and_serve(ctx: HostContext, step: Step, serving: Step) -> Step:
    """A copy step that also serves this host's cross builds (`serving`, from _serve)."""
    if serving.noop:
        return step
    if step.noop:
        return serving
    change = step.change
    reason = f"{change.reason}; then {serving.change.reason}"
    return replace(step, change=replace(change, reason=reason,
                                        diffs=[*change.diffs, *serving.change.diffs]),
                   commands=[*step.commands, *serving.commands])


def _copy(ctx: HostContext, decision: keys.Decision) -> Step:
    """The copying host's part of llama_cpp.copy (copy())."""
    cluster, host, commit = ctx.cluster, ctx.host, run.of(ctx.resolved).commit
    have = ctx.fact("llama_cpp.Builds") or {"current": None, "builds": {}}
    if commit is None:  # the ref is resolved at apply: what is copied is known then
        return Step(_copy_change(ctx, decision, have.get("current"), None),
                    build=BuildOutcome(None, changed=True))
    if keys.covers(have["builds"].get(decision.key), decision.targets):
        return Step(ctx.change(ROLE, "copy", "no-op", f"{decision.key} installed"))
    builder = decision.builder
    if builder in ctx.failed_hosts:
        raise ApplyError(f"{host.name}: nothing to copy: the build of {decision.key} on "
                         f"{builder} failed in this run; current is unchanged",
                         hint=f"fix {builder}'s llama_cpp.build, or compile here with "
                              f"-replace={host.name}/llama_cpp.build")
    seen = archive_of(ctx, builder, decision.key)
    if seen is None and ctx.run_command is not None:  # apply: the builder packed it by now
        raise ApplyError(f"{host.name}: {builder} has no tarball of build {decision.key} to "
                         "copy; current is unchanged",
                         hint=f"apply again (its llama_cpp.build packs it), or compile here with "
                              f"-replace={host.name}/llama_cpp.build")
    name = f"{decision.key}.tar.gz"
    script = shell.template(
        TEMPLATES / "copy.sh", prelude=progress.SHELL + "\n" + shell.SHA256,
        URL=share.lan_url(cluster, builder, name), SUMURL=share.lan_url(cluster, builder,
                                                                         f"{name}.sha256"),
        EXPECT=seen[0] if seen else "", SIZE=seen[1] if seen else 0,
        OUT=installed_build(ctx.prefix, decision.key),
        KEY=decision.key, COMMIT=checked_commit(commit), BUILDER=builder, HOST=host.name,
        WAIT=int(d.llama_cpp_copy_wait),
        ARCHIVE=archive(cluster.host(builder).layout.prefix, decision.key))
    # Without the builder's sha256 (a plan before its tarball exists) the commands are known
    # after apply: a copy is never checked against what the LAN alone says.
    return Step(_copy_change(ctx, decision, have.get("current"), seen),
                [script, activate_script(ctx, decision.key)] if seen else [],
                sudo=not host.rootless, build=BuildOutcome(decision.key, changed=True))


def _copy_change(ctx: HostContext, decision: keys.Decision, current: str | None,
                 seen: tuple[str, int] | None):
    """What the plan says of a copy: from where, how many bytes (`seen`: the builder's tarball,
    when the plan saw it), the build it makes current (known after apply while the ref is
    not resolved)."""
    resolved = run.of(ctx.resolved).commit is not None
    diffs = [AttrDiff("from", None, decision.builder),
             AttrDiff("bytes", None, str(seen[1]) if seen else None,
                      known_after_apply=seen is None)]
    if current:
        diffs.insert(0, AttrDiff("current", current, decision.key if resolved else None,
                                 known_after_apply=not resolved))
    size = f"{seen[1] / 2**20:.1f} MiB" if seen else "its build"
    how = (f"cross-compiled on {decision.builder} for {decision.cross}" if decision.cross
           else "compiled there")
    return ctx.change(ROLE, "copy", "replace" if current else "create",
                      f"copy {size} from {decision.builder} {share.way(ctx.cluster)} "
                      f"({how} once for {', '.join(decision.members)})", diffs)


def _serve(ctx: HostContext, decisions: list[keys.Decision]) -> Step:
    """The builder's part of llama_cpp.copy: serve its tarballs (packed by its llama_cpp.build
    and llama_cpp.cross; pack.sh keeps them) to the hosts of each key that lack the build,
    through md-share (its port open to them alone: network.allowlist)."""
    cluster = ctx.cluster
    wanted = [(dec, lacking_hosts(ctx, dec)) for dec in decisions]
    wanted = [(dec, lacking) for dec, lacking in wanted if lacking]
    if not wanted:
        return Step(ctx.change(ROLE, "copy", "no-op", "no host copies a build from here"))
    files, clients = {}, []
    for dec, lacking in wanted:
        path = archive(ctx.prefix, dec.key)
        files.update({f"{dec.key}.tar.gz": path, f"{dec.key}.tar.gz.sha256": f"{path}.sha256"})
        clients += [m for m in lacking if m not in clients]
    # A build compiled in this run is served for the first time (created with it, so a first
    # plan only adds); an installed one is served again to a host that lacks it.
    have = ((ctx.fact("llama_cpp.Builds") or {}).get("builds") or {})
    served = run.of(ctx.resolved).commit is not None and all(dec.key in have for dec, _ in wanted)
    what = ", ".join(dec.key for dec, _ in wanted) if run.of(ctx.resolved).commit else "its build"
    change = ctx.change(ROLE, "copy", "update" if served else "create",
                        f"serve {what} to {', '.join(clients)} {share.way(cluster)} while they "
                        "copy it (md-share)",
                        [AttrDiff("md-share", None, ", ".join(clients))])
    # The build is known after apply, and so are the commands.
    if run.of(ctx.resolved).commit is None:
        return Step(change)
    return Step(change,
                [*(pack_script(ctx, dec.key) for dec, _ in wanted),
                 *share.start(cluster, ctx.host, files, [cluster.host(m) for m in clients])],
                sudo=not ctx.host.rootless)
