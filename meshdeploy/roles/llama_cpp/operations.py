"""llama_cpp: the clone pinned to one commit, and per-backend builds with an atomic `current`."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from meshdeploy.core import inflight, progress, shell
from meshdeploy.core.context import BuildOutcome, HostContext, Step, stored_teardown
from meshdeploy.errors import PlanError
from meshdeploy.core.paths import installed_build
from meshdeploy.core.paths import llama_cpp_paths as paths
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.probe import Section
from meshdeploy.roles.llama_cpp import defaults as d
from meshdeploy.roles.llama_cpp import lock
from meshdeploy.roles.llama_cpp.facts import (
    GIT_SAFE,
    Builds,
    CcacheWritable,
    RemoteRef,
    Source,
    Stored,
)
from meshdeploy.roles.llama_cpp.lock import checked_commit

ROLE = "llama_cpp"
TEMPLATES = Path(__file__).with_name("templates")


def sections(cluster, host, commit: str | None, first: bool) -> list[Section]:
    p = paths(host.layout.prefix)
    # Facts take raw values and quote them themselves (core.shell).
    out = [Section("llama_cpp.Source", Source, {"path": p["src"], "commit": commit}),
           Section("llama_cpp.Builds", Builds,
                   {"builds_dir": p["builds"], "current_link": p["current"]})]
    if first:
        out.append(Section("llama_cpp.RemoteRef", RemoteRef,
                           {"repo": cluster.llama_cpp.repo, "ref": cluster.llama_cpp.ref}))
    b = cluster.llama_cpp.build
    if host.rootless and b.ccache and b.ccache_dir and targets(cluster, host):
        out.append(Section("llama_cpp.CcacheWritable", CcacheWritable, {"path": b.ccache_dir}))
    return out


def preflight(ctx: HostContext) -> None:
    """A rootless host builds as its login user: a ccache_dir the file sets must be one that
    user can write (a system path usually is root's), else every compile would fail."""
    if ctx.fact("llama_cpp.CcacheWritable") is False:
        path = ctx.cluster.llama_cpp.build.ccache_dir
        raise PlanError(f"host {ctx.host.name} is rootless and cannot write "
                        f"llama_cpp.build.ccache_dir {path}",
                        hint="remove ccache_dir (a rootless host then keeps its ccache in its "
                             "user's cache folder), or make the folder writable by that user")


def targets(cluster, host) -> list[str]:
    """What this host needs: llama-server where a server runs, the worker where RPC is served."""
    wanted = []
    if any(s.host == host.name for s in cluster.servers):
        wanted.append(d.llama_cpp_server_target)
    if host.rpc_servers:
        wanted.append("rpc")
    return wanted


_NATIVE = re.compile(r"(-D\s*)?GGML_NATIVE[:=]")


def cmake_flags(cluster, host, termux: bool = False) -> list[str]:
    """The build's cmake flags; `termux`: the host is Termux (toolchain.Platform), whose builds
    get d.llama_cpp_termux_cmake_flags unless llama_cpp.build.cmake_flags set GGML_NATIVE."""
    b = cluster.llama_cpp.build
    host_flags = d.llama_cpp_termux_cmake_flags if termux and not any(
        _NATIVE.match(f) for f in b.cmake_flags) else ()
    return ([f"-DCMAKE_BUILD_TYPE={b.type}", *d.llama_cpp_common_cmake_flags,
             *d.llama_cpp_backend_cmake_flags[host.backend], *host_flags,
             f"-DGGML_CCACHE={'ON' if b.ccache else 'OFF'}", *b.cmake_flags])


def flavour(cluster, host, termux: bool = False) -> str:
    """Hash of everything but the commit that makes two builds differ."""
    blob = "\n".join([host.backend, *cmake_flags(cluster, host, termux), *targets(cluster, host)])
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def build_key(cluster, host, commit: str, termux: bool = False) -> str:
    return f"{commit[:12]}-{host.backend}-{flavour(cluster, host, termux)}"


def on_termux(ctx: HostContext) -> bool:
    """Whether the probe found Termux on this host (the toolchain role's Platform fact)."""
    return bool((ctx.fact("toolchain.Platform") or {}).get("termux"))


def ccache_dir(cluster, host) -> str:
    """CCACHE_DIR of the host's builds: llama_cpp.build.ccache_dir when the file sets it; on a
    rootless host meshdeploy's folder under the user's cache (destroy --purge removes it);
    else "" (ccache's own default)."""
    b = cluster.llama_cpp.build
    if not b.ccache:
        return ""
    if b.ccache_dir:
        return b.ccache_dir
    return f"{host.layout.cache}/{d.llama_cpp_rootless_ccache_dir}" if host.rootless else ""


def source(ctx: HostContext) -> Step:
    """llama_cpp.source: the clone at the pinned commit (fetch, never re-clone, when it moved)."""
    cluster, commit = ctx.cluster, ctx.resolved.commit
    repo = cluster.llama_cpp.repo
    if not targets(cluster, ctx.host):
        return Step(ctx.change(ROLE, "source", "no-op", "host runs no llama.cpp binary"))
    src = paths(ctx.prefix)["src"]
    have = ctx.fact("llama_cpp.Source")
    short = commit[:12] if commit else None
    if have is None:
        change = ctx.change(ROLE, "source", "create", f"clone {repo}",
                            [AttrDiff("repo", None, repo),
                             AttrDiff("commit", None, short, known_after_apply=commit is None)])
        if commit is None:
            return Step(change)  # commands known after apply
        return Step(change, [inflight.guarded("llama_cpp.source",
                                              clone_script(src, repo, checked_commit(commit)),
                                              ctx.host.layout)], sudo=not ctx.host.rootless)
    if commit is not None and have["head"] == commit and have["url"] == repo:
        return Step(ctx.change(ROLE, "source", "no-op", f"at {short}"))
    diffs = [AttrDiff("commit", have["head"][:12], short, known_after_apply=commit is None)]
    cmds = []
    if have["url"] != repo:
        diffs.insert(0, AttrDiff("repo", have["url"], repo))
        cmds.append(shell.command("git", "-C", src, "remote", "set-url", "--", "origin", repo))
    change = ctx.change(ROLE, "source", "update", "pin moved" if have["head"] != commit
                        else "origin changed", diffs)
    if commit is None:
        return Step(change)  # commands known after apply
    if not have.get("has_commit") or have["url"] != repo:
        cmds.append(shell.command("git", *GIT_SAFE, "-C", src, "fetch", "--quiet", "--tags",
                                  "origin"))
    cmds.append(shell.command("git", "-C", src, "-c", "advice.detachedHead=false", "checkout",
                              "--quiet", "--force", "--detach", checked_commit(commit)))
    return Step(change, cmds, sudo=not ctx.host.rootless)


_CLONE = ('rm -rf "$SRC.tmp" && git -c protocol.ext.allow=never clone --quiet --no-checkout '
          '-- "$REPO" "$SRC.tmp" && '
          'git -C "$SRC.tmp" -c advice.detachedHead=false checkout --quiet --detach "$COMMIT" && '
          'mkdir -p "$(dirname "$SRC")" && mv "$SRC.tmp" "$SRC"')


def clone_script(src: str, repo: str, commit: str) -> str:
    return shell.script(_CLONE, SRC=src, REPO=repo, COMMIT=commit)


def build_script(ctx: HostContext, key: str) -> str:
    cluster, host = ctx.cluster, ctx.host
    p = paths(ctx.prefix)
    b = cluster.llama_cpp.build
    wanted = targets(cluster, host)
    number = ctx.resolved.build_number
    termux = on_termux(ctx)
    return shell.template(
        TEMPLATES / "build.sh", args=cmake_flags(cluster, host, termux), prelude=progress.SHELL,
        SRC=p["src"], TREE=f"{p['build']}/{host.backend}-{flavour(cluster, host, termux)}",
        OUT=installed_build(ctx.prefix, key), COMMIT=checked_commit(ctx.resolved.commit),
        NUMBER="" if number is None else int(number), JOBS=int(b.jobs) if b.jobs else "",
        CCACHE=ccache_dir(cluster, host),
        WANT_SERVER=int(d.llama_cpp_server_target in wanted), WANT_RPC=int("rpc" in wanted),
        RPC_TARGETS=" ".join(d.llama_cpp_rpc_targets), KEY=key, BACKEND=host.backend)


def activate_script(ctx: HostContext, key: str) -> str:
    """Flip `current` atomically and prune old builds beyond keep_builds (never the current)."""
    p = paths(ctx.prefix)
    return shell.template(TEMPLATES / "activate.sh", TARGET=f"{d.llama_cpp_builds_dir}/{key}",
                          CURRENT=p["current"], BUILDS=p["builds"], KEY=key,
                          KEEP=int(ctx.cluster.llama_cpp.keep_builds))


def build(ctx: HostContext) -> Step:
    """llama_cpp.build: compile llama-server and the RPC worker for this host's backend."""
    cluster, host, commit = ctx.cluster, ctx.host, ctx.resolved.commit
    if not targets(cluster, host):
        return Step(ctx.change(ROLE, "build", "no-op", "host runs no llama.cpp binary"))
    have = ctx.fact("llama_cpp.Builds") or {"current": None, "builds": {}}
    current = have.get("current")
    current_commit = (have["builds"].get(current) or {}).get("commit") if current else None
    if commit is None:
        return Step(ctx.change(ROLE, "build", "replace" if current else "create",
                               "ref not resolved yet",
                               [AttrDiff("commit", current_commit and current_commit[:12], None,
                                         forces_replacement=bool(current), known_after_apply=True)]),
                    build=BuildOutcome(None, changed=True))
    key = build_key(cluster, host, commit, on_termux(ctx))
    root = not host.rootless  # a rootless host: nothing through sudo
    if key in have["builds"]:
        if current == key:
            return Step(ctx.change(ROLE, "build", "no-op", f"{key} built and current"),
                        build=BuildOutcome(key, changed=False))
        return Step(ctx.change(ROLE, "build", "update", "switch to an existing build (no compile)",
                               [AttrDiff("current", current, key)]),
                    [activate_script(ctx, key)], sudo=root,
                    build=BuildOutcome(key, changed=True))
    diffs = [AttrDiff("commit", current_commit and current_commit[:12], commit[:12],
                      forces_replacement=bool(current)),
             AttrDiff("backend", None if current else None, host.backend),
             AttrDiff("targets", None, " ".join(targets(cluster, host)))]
    return Step(ctx.change(ROLE, "build", "replace" if current else "create",
                           f"no build of {commit[:12]} for {host.backend} with these flags", diffs),
                [inflight.guarded("llama_cpp.build", build_script(ctx, key), host.layout),
                 activate_script(ctx, key)],
                sudo=root, build=BuildOutcome(key, changed=True))


def resolve(ctx: HostContext) -> Step:
    """llama_cpp.resolve (apply only): the ref resolved on the first host, when the plan could
    not (no git anywhere yet); a no-op everywhere else."""
    if ctx.resolved.commit is not None or not ctx.first:
        return Step(ctx.change(ROLE, "resolve", "no-op", "ref already resolved"))
    fixed = lock.resolve_on_host(ctx)
    return Step(ctx.change(ROLE, "resolve", "no-op",
                           f"{ctx.cluster.llama_cpp.ref} -> {fixed['commit'][:12]}"),
                resolves=fixed)


def destroy(ctx: HostContext, purge: bool):
    """The clone, cmake trees, builds and `current` link; only with purge (a build costs minutes
    of every core). The prefix itself goes once nothing else is in it; a ccache folder the file
    names is shared with other builds and stays (on a rootless host meshdeploy's own under the
    user's cache goes with the rest)."""
    stored = ctx.fact("llama_cpp.Stored") or {}
    builds = sorted((ctx.fact("llama_cpp.Builds") or {}).get("builds", {}))
    what = f"llama.cpp builds {', '.join(builds)}" if builds else "the llama.cpp clone"
    parents = [f"{ctx.prefix}/src", ctx.prefix]
    if own_ccache(ctx.cluster, ctx.host):
        parents.append(ctx.host.layout.cache)
    return stored_teardown(ctx, ROLE, "build", stored, what, purge,
                           (shell.command("rmdir", *parents, shell.QUIET, shell.OR, "true"),))


def own_ccache(cluster, host) -> str:
    """The ccache folder meshdeploy made on a rootless host (not one the file names), or ""."""
    b = cluster.llama_cpp.build
    return ccache_dir(cluster, host) if host.rootless and not b.ccache_dir else ""


def destroy_sections(cluster, host) -> list[Section]:
    p = paths(host.layout.prefix)
    stored = [p["src"], p["build"], p["builds"], p["current"]]
    if own_ccache(cluster, host):
        stored.append(own_ccache(cluster, host))
    return [Section("llama_cpp.Stored", Stored, {"paths": stored})]
