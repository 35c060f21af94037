"""llama_cpp: the clone pinned to one commit, and per-backend builds with an atomic `current`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshdeploy.core import inflight, progress, shell
from meshdeploy.core.context import BuildOutcome, HostContext, Step, stored_teardown
from meshdeploy.errors import PlanError
from meshdeploy.core.paths import installed_build
from meshdeploy.core.paths import llama_cpp_paths as paths
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.probe import Section
from meshdeploy.roles.llama_cpp import defaults as d
from meshdeploy.roles.llama_cpp import keys, lock, run, settings
from meshdeploy.roles.llama_cpp.facts import (
    GIT_SAFE,
    Builds,
    CcacheWritable,
    CpuFlags,
    CudaCompute,
    Hip,
    Libc,
    RemoteRef,
    Source,
    Stored,
)
from meshdeploy.roles.llama_cpp.keys import (  # noqa: F401 (the role's API, used by tests)
    build_key,
    cmake_flags,
    flavour,
    targets,
)
from meshdeploy.roles.llama_cpp.lock import checked_commit

ROLE = "llama_cpp"
CROSS_RESOURCE = "llama_cpp.cross"
TEMPLATES = Path(__file__).with_name("templates")


def sections(cluster, host, commit: str | None, first: bool) -> list[Section]:
    p = paths(host.layout.prefix)
    # Facts take raw values and quote them themselves (core.shell).
    out = [Section("llama_cpp.Source", Source, {"path": p["src"], "commit": commit}),
           Section("llama_cpp.Builds", Builds,
                   {"builds_dir": p["builds"], "current_link": p["current"],
                    "archives_dir": archives_dir(host.layout.prefix)}),
           Section("llama_cpp.Libc", Libc)]
    if first:
        out.append(Section("llama_cpp.RemoteRef", RemoteRef,
                           {"repo": settings.of(cluster).repo, "ref": settings.of(cluster).ref}))
    if targets(cluster, host):  # shared builds stay native where every CPU is the same
        out.append(Section("llama_cpp.CpuFlags", CpuFlags))
    if host.backend == "cuda":
        out.append(Section("llama_cpp.CudaCompute", CudaCompute))
    if host.backend == "rocm":
        out.append(Section("llama_cpp.Hip", Hip))
    b = settings.of(cluster).build
    if host.rootless and b.ccache and b.ccache_dir and targets(cluster, host):
        out.append(Section("llama_cpp.CcacheWritable", CcacheWritable, {"path": b.ccache_dir}))
    return out


def preflight(ctx: HostContext) -> None:
    """A rootless host builds as its login user: a ccache_dir the file sets must be one that
    user can write (a system path usually is root's), else every compile would fail. A GPU
    build needs to know the GPU code it compiles for, and a ROCm one a HIP the tree accepts."""
    if targets(ctx.cluster, ctx.host):
        refuse_gpu(ctx)
    if ctx.fact("llama_cpp.CcacheWritable") is False:
        path = settings.of(ctx.cluster).build.ccache_dir
        raise PlanError(f"host {ctx.host.name} is rootless and cannot write "
                        f"llama_cpp.build.ccache_dir {path}",
                        hint="remove ccache_dir (a rootless host then keeps its ccache in its "
                             "user's cache folder), or make the folder writable by that user")


_GPU_SETTING = {"cuda": ("llama_cpp.build.cuda_architectures", "no NVIDIA driver answers "
                         "(nvidia-smi)", "[86] for an RTX 30xx; nvidia-smi "
                         "--query-gpu=compute_cap on the GPU host tells"),
                "rocm": ("llama_cpp.build.amdgpu_targets", "ROCm reports no AMD GPU "
                         "(rocm_agent_enumerator)", "[gfx1030]; rocminfo on the GPU host tells")}


def refuse_gpu(ctx: HostContext) -> None:
    """PlanError where a cuda or rocm build cannot be made as the file says on this host."""
    host, backend = ctx.host, ctx.host.backend
    if backend == "rocm":
        hip = ctx.fact("llama_cpp.Hip") or {}
        have = hip.get("version") or hip.get("candidate")
        need = d.llama_cpp_hip_min
        if have and tuple(have) < need:
            how = "has" if hip.get("version") else "would install from apt"
            raise PlanError(f"llama.cpp {settings.of(ctx.cluster).ref} needs ROCm/HIP >= "
                            f"{need[0]}.{need[1]}; host {host.name} {how} HIP "
                            f"{have[0]}.{have[1]}",
                            hint="install ROCm >= 6.1 from AMD's repositories on it, or set "
                                 f"hosts.{host.name}.backend to vulkan (Mesa's RADV runs AMD GPUs)")
    if backend in _GPU_SETTING and keys.gpu_code(ctx.cluster, host, ctx.facts) is None:
        setting, why, example = _GPU_SETTING[backend]
        raise PlanError(f"host {host.name} builds llama.cpp for {backend} but the GPU code to "
                        f"compile is unknown: {why} and {setting} is empty",
                        hint=f"set {setting} (e.g. {example})")


def archives_dir(prefix: str) -> str:
    """Where a builder keeps the tarballs of builds that other hosts copy."""
    return f"{paths(prefix)['build']}/{d.llama_cpp_share_dir}"


def archive(prefix: str, key: str) -> str:
    return f"{archives_dir(prefix)}/{key}.tar.gz"


def on_termux(ctx: HostContext) -> bool:
    """Whether the probe found Termux on this host (the toolchain role's Platform fact)."""
    return bool((ctx.fact("toolchain.Platform") or {}).get("termux"))


def ccache_dir(cluster, host) -> str:
    """CCACHE_DIR of the host's builds: llama_cpp.build.ccache_dir when the file sets it; on a
    rootless host meshdeploy's folder under the user's cache (destroy --purge removes it);
    else "" (ccache's own default)."""
    b = settings.of(cluster).build
    if not b.ccache:
        return ""
    if b.ccache_dir:
        return b.ccache_dir
    return f"{host.layout.cache}/{d.llama_cpp_rootless_ccache_dir}" if host.rootless else ""


def source(ctx: HostContext) -> Step:
    """llama_cpp.source: the clone at the pinned commit (fetch, never re-clone, when it moved)."""
    cluster, commit = ctx.cluster, run.of(ctx.resolved).commit
    repo = settings.of(cluster).repo
    if not targets(cluster, ctx.host):
        return Step(ctx.change(ROLE, "source", "no-op", "host runs no llama.cpp binary"))
    decision = keys.decide(ctx)
    if decision.copies(ctx.host.name):
        return Step(ctx.change(ROLE, "source", "no-op",
                               f"copies its build from {decision.builder}: no clone needed"))
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


def build_script(ctx: HostContext, key: str, decision: keys.Decision | None = None,
                 force: bool = False, target: HostContext | None = None) -> str:
    """build.sh for build `key`: the targets and flags `decision` says (keys.decide), `force`:
    compile even when the build is installed (-replace); `target`: a host of another
    architecture whose flags the build gets, cross-compiled for it (llama_cpp.cross)."""
    cluster, host = ctx.cluster, ctx.host
    decision = decision or keys.decide(ctx)
    p = paths(ctx.prefix)
    b = settings.of(cluster).build
    wanted = decision.targets
    number = run.of(ctx.resolved).build_number
    of = target or ctx  # the host whose binaries these are
    termux = on_termux(of)
    portable = decision.portable
    cross = keys.machine(of.facts) if target else ""
    if cross and cross not in d.llama_cpp_cross_triplets:  # keys.cross_builder never plans one
        raise ValueError(f"no cross compiler is known for machine {cross!r}")
    triplet = d.llama_cpp_cross_triplets.get(cross, "") if cross else ""
    tree = f"{host.backend}-{flavour(cluster, of.host, termux, None, portable, of.facts)}"
    return shell.template(
        TEMPLATES / "build.sh", args=cmake_flags(cluster, of.host, termux, portable, of.facts),
        prelude=progress.SHELL, SRC=p["src"],
        TREE=f"{p['build']}/{tree}{'-' + cross if cross else ''}",
        CROSS=cross, TRIPLET=triplet, CROSS_ROOT=f"/usr/{triplet}" if triplet else "",
        OUT=installed_build(ctx.prefix, key), COMMIT=checked_commit(run.of(ctx.resolved).commit),
        NUMBER="" if number is None else int(number), JOBS=int(b.jobs) if b.jobs else "",
        CCACHE=ccache_dir(cluster, host),
        WANT_SERVER=int(d.llama_cpp_server_target in wanted), WANT_RPC=int("rpc" in wanted),
        RPC_TARGETS=" ".join(d.llama_cpp_rpc_targets), KEY=key, BACKEND=host.backend,
        FORCE=int(force))


def activate_script(ctx: HostContext, key: str) -> str:
    """Flip `current` atomically and prune old builds beyond keep_builds (never the current)."""
    p = paths(ctx.prefix)
    return shell.template(TEMPLATES / "activate.sh", TARGET=f"{d.llama_cpp_builds_dir}/{key}",
                          CURRENT=p["current"], BUILDS=p["builds"], KEY=key,
                          KEEP=int(settings.of(ctx.cluster).keep_builds))


def build(ctx: HostContext) -> Step:
    """llama_cpp.build: compile llama-server and the RPC worker for this host's backend, once per
    build key: a host whose key another host compiles copies that build (llama_cpp.copy).

    + -replace=HOST/llama_cpp.build: compile on HOST, whatever is installed or shared
    """
    cluster, host, commit = ctx.cluster, ctx.host, run.of(ctx.resolved).commit
    if not targets(cluster, host):
        return Step(ctx.change(ROLE, "build", "no-op", "host runs no llama.cpp binary"))
    have = ctx.fact("llama_cpp.Builds") or {"current": None, "builds": {}}
    current = have.get("current")
    current_commit = (have["builds"].get(current) or {}).get("commit") if current else None
    decision = keys.decide(ctx)
    key = decision.key
    installed = have["builds"].get(key) if commit else None
    if decision.copies(host.name) and not keys.covers(installed, decision.targets):
        return Step(ctx.change(ROLE, "build", "no-op",
                               f"{decision.builder} compiles {key if commit else 'its build'} "
                               f"({decision.why}); llama_cpp.copy copies it here"))
    copiers = decision.copiers() if decision.builder == host.name else []
    why = "; ".join(w for w in (decision.why, decision.code) if w)
    once = f"; compiled once for {', '.join([host.name, *copiers])} ({why})" if copiers else ""
    if commit is None:
        return Step(ctx.change(ROLE, "build", "replace" if current else "create",
                               f"ref not resolved yet{once}",
                               [AttrDiff("commit", current_commit and current_commit[:12], None,
                                         forces_replacement=bool(current), known_after_apply=True),
                                *([AttrDiff("copied by", None, ", ".join(copiers))]
                                  if copiers else [])]),
                    build=BuildOutcome(None, changed=True))
    root = not host.rootless  # a rootless host: nothing through sudo
    forced = ctx.replacing(keys.RESOURCE)
    lacking = lacking_hosts(ctx, decision)
    pack = [pack_script(ctx, key)] if lacking else []
    if not forced and keys.covers(installed, decision.targets):
        unpacked = pack and archive_of(ctx, host.name, key) is None
        if current == key and not unpacked:
            return Step(ctx.change(ROLE, "build", "no-op", f"{key} built and current"),
                        build=BuildOutcome(key, changed=False))
        if current == key:
            return Step(ctx.change(ROLE, "build", "update",
                                   f"pack {key} for {', '.join(lacking)} to copy (no compile)",
                                   [AttrDiff("tarball", None, key, known_after_apply=True)]),
                        pack, sudo=root, build=BuildOutcome(key, changed=False))
        return Step(ctx.change(ROLE, "build", "update", "switch to an existing build (no compile)",
                               [AttrDiff("current", current, key)]),
                    [activate_script(ctx, key), *(pack if unpacked else [])], sudo=root,
                    build=BuildOutcome(key, changed=True))
    diffs = [AttrDiff("commit", current_commit and current_commit[:12], commit[:12],
                      forces_replacement=bool(current)),
             AttrDiff("backend", None, host.backend),
             AttrDiff("targets", None, " ".join(decision.targets))]
    reason = f"no build of {commit[:12]} for {host.backend} with these flags"
    if forced:
        reason = f"-replace: compile {key} here"
    elif installed:
        reason = f"{key} lacks binaries its hosts need"
    if copiers:
        reason += once
        diffs.append(AttrDiff("copied by", None, ", ".join(copiers)))
    return Step(ctx.change(ROLE, "build", "replace" if current or forced else "create", reason,
                           diffs),
                [inflight.guarded("llama_cpp.build", build_script(ctx, key, decision, forced),
                                  host.layout),
                 activate_script(ctx, key), *pack],
                sudo=root, build=BuildOutcome(key, changed=True))


def cross(ctx: HostContext) -> Step:
    """llama_cpp.cross: the builds this host cross-compiles for hosts of another architecture
    (keys.py: an x86-64 host for the aarch64 hosts of its release), after its own build; each
    installed beside its own builds (never current here: it cannot run them) and packed for
    the hosts that copy it (llama_cpp.copy)."""
    jobs = keys.cross_builds(ctx)
    if not jobs:
        return Step(ctx.change(ROLE, "cross", "no-op", "builds for no other architecture"))
    have = (ctx.fact("llama_cpp.Builds") or {}).get("builds") or {}
    commit = run.of(ctx.resolved).commit
    names = ", ".join(sorted({keys.machine(ctx.cluster_facts[j.members[0]]) or "?"
                              for j in jobs}))
    if commit is None:
        return Step(ctx.change(ROLE, "cross", "create",
                               f"ref not resolved yet; cross-compiled here for {names}",
                               [AttrDiff("for", None, ", ".join(m for j in jobs
                                                                for m in j.members))]))
    forced = ctx.replacing(CROSS_RESOURCE)  # -replace=HOST/llama_cpp.cross
    cmds, diffs, compiled = [], [], []
    for job in jobs:
        target = HostContext(ctx.cluster, ctx.cluster.host(job.members[0]),
                             ctx.cluster_facts[job.members[0]], ctx.resolved,
                             cluster_facts=ctx.cluster_facts)
        lacking = lacking_hosts(ctx, job)
        if not forced and keys.covers(have.get(job.key), job.targets):
            if lacking and archive_of(ctx, ctx.host.name, job.key) is None:
                cmds.append(pack_script(ctx, job.key))
                diffs.append(AttrDiff("tarball", None, job.key, known_after_apply=True))
            continue
        compiled.append(job.key)
        cmds += [inflight.guarded("llama_cpp.cross", build_script(ctx, job.key, job, forced,
                                                                   target), ctx.host.layout),
                 pack_script(ctx, job.key)]
        diffs += [AttrDiff("build", None, job.key),
                  AttrDiff("for", None, ", ".join(job.members)),
                  AttrDiff("targets", None, " ".join(job.targets))]
    if not cmds:
        return Step(ctx.change(ROLE, "cross", "no-op",
                               f"{', '.join(j.key for j in jobs)} built for "
                               f"{', '.join(m for j in jobs for m in j.members)}"))
    what = (f"cross-compile {', '.join(compiled)} for {names} ({jobs[0].code})" if compiled
            else f"pack {', '.join(diff.after for diff in diffs)} to copy (no compile)")
    # No BuildOutcome: this host's services keep running its own build.
    return Step(ctx.change(ROLE, "cross", "create" if compiled else "update", what, diffs),
                cmds, sudo=not ctx.host.rootless)


def pack_script(ctx: HostContext, key: str) -> str:
    """pack.sh: the tarball of installed build `key` and its sha256, for the hosts that copy it
    (their copies are checked against that sha256, which apply reads back from this host)."""
    return shell.template(TEMPLATES / "pack.sh", prelude=shell.SHA256,
                          BUILD=installed_build(ctx.prefix, key), ARCHIVE=archive(ctx.prefix, key))


def lacking_hosts(ctx: HostContext, decision: keys.Decision) -> list[str]:
    """The hosts that copy this builder's build and lack it (none where this host copies)."""
    if decision.builder != ctx.host.name:
        return []
    cluster = ctx.cluster
    return [m for m in decision.copiers()
            if not keys.covers(((ctx.fact_of(m, "llama_cpp.Builds") or {}).get("builds")
                                or {}).get(decision.key),
                               keys.targets(cluster, cluster.host(m)))]


def archive_of(ctx: HostContext, builder: str, key: str) -> tuple[str, int] | None:
    """(sha256, bytes) of the tarball of `key` the plan saw on `builder`, if any."""
    builds = (ctx.fact_of(builder, "llama_cpp.Builds") or {}).get("builds") or {}
    words = ((builds.get(key) or {}).get("archive") or "").split()
    if len(words) == 2 and keys.SHA256.fullmatch(words[0]) and words[1].isdigit():
        return words[0], int(words[1])
    return None


def resolve(ctx: HostContext) -> Step:
    """llama_cpp.resolve (apply only): the ref resolved on the first host, when the plan could
    not (no git anywhere yet); a no-op everywhere else."""
    if run.of(ctx.resolved).commit is not None or not ctx.first:
        return Step(ctx.change(ROLE, "resolve", "no-op", "ref already resolved"))
    commit = lock.resolve_on_host(ctx)
    # Who copies from whom, decided again with the commit (keys.copiers): the same as the
    # plan's unless a host already holds the build of that commit.
    hosts = [h for h in ctx.cluster.hosts if h.name in (ctx.cluster_facts or {})]
    copiers = keys.copiers(ctx.cluster, hosts, ctx.cluster_facts or {}, commit,
                           ctx.resolved.replace)
    fixed = replace(run.of(ctx.resolved), commit=commit, build_copiers=copiers)
    return Step(ctx.change(ROLE, "resolve", "no-op",
                           f"{settings.of(ctx.cluster).ref} -> {commit[:12]}"),
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
    b = settings.of(cluster).build
    return ccache_dir(cluster, host) if host.rootless and not b.ccache_dir else ""


def destroy_sections(cluster, host) -> list[Section]:
    p = paths(host.layout.prefix)
    stored = [p["src"], p["build"], p["builds"], p["current"]]
    if own_ccache(cluster, host):
        stored.append(own_ccache(cluster, host))
    return [Section("llama_cpp.Stored", Stored, {"paths": stored})]
