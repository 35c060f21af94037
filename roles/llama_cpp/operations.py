"""llama_cpp: the clone pinned to one commit, and per-backend builds with an atomic `current`."""

from __future__ import annotations

import hashlib

from meshdeploy.deploy.context import HostContext, Step, q
from meshdeploy.deploy.plan import AttrDiff
from meshdeploy.deploy.probe import Section
from meshdeploy.roles.llama_cpp import defaults as d
from meshdeploy.roles.llama_cpp.facts import Builds, RemoteRef, Source

ROLE = "llama_cpp"


def paths(prefix: str) -> dict[str, str]:
    return {"src": f"{prefix}/{d.llama_cpp_src_dir}",
            "build": f"{prefix}/{d.llama_cpp_build_dir}",
            "builds": f"{prefix}/{d.llama_cpp_builds_dir}",
            "current": f"{prefix}/{d.llama_cpp_current_link}"}


def sections(cluster, host, commit: str | None, first: bool) -> list[Section]:
    p = paths(cluster.llama_cpp.prefix)
    # Fact commands take shell words: the prefix may hold spaces.
    out = [Section("llama_cpp.Source", Source, {"path": q(p["src"]), "commit": commit}),
           Section("llama_cpp.Builds", Builds,
                   {"builds_dir": q(p["builds"]), "current_link": q(p["current"])})]
    if first:
        out.append(Section("llama_cpp.RemoteRef", RemoteRef,
                           {"repo": q(cluster.llama_cpp.repo), "ref": q(cluster.llama_cpp.ref)}))
    return out


def targets(cluster, host) -> list[str]:
    """What this host needs: llama-server where a server runs, the worker where RPC is served."""
    wanted = []
    if any(s.host == host.name for s in cluster.servers):
        wanted.append(d.llama_cpp_server_target)
    if host.rpc_servers:
        wanted.append("rpc")
    return wanted


def cmake_flags(cluster, host) -> list[str]:
    b = cluster.llama_cpp.build
    return ([f"-DCMAKE_BUILD_TYPE={b.type}", *d.llama_cpp_common_cmake_flags,
             *d.llama_cpp_backend_cmake_flags[host.backend],
             f"-DGGML_CCACHE={'ON' if b.ccache else 'OFF'}", *b.cmake_flags])


def flavour(cluster, host) -> str:
    """Hash of everything but the commit that makes two builds differ."""
    blob = "\n".join([host.backend, *cmake_flags(cluster, host), *targets(cluster, host)])
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def build_key(cluster, host, commit: str) -> str:
    return f"{commit[:12]}-{host.backend}-{flavour(cluster, host)}"


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
            return Step(change, deferred=True)
        return Step(change, [
            f"rm -rf {q(src)}.tmp && git clone --quiet --no-checkout {q(repo)} {q(src)}.tmp && "
            f"git -C {q(src)}.tmp -c advice.detachedHead=false checkout --quiet --detach {commit} && "
            f"mkdir -p {q(src.rsplit('/', 1)[0])} && mv {q(src)}.tmp {q(src)}"])
    if commit is not None and have["head"] == commit and have["url"] == repo:
        return Step(ctx.change(ROLE, "source", "no-op", f"at {short}"))
    diffs = [AttrDiff("commit", have["head"][:12], short, known_after_apply=commit is None)]
    cmds = []
    if have["url"] != repo:
        diffs.insert(0, AttrDiff("repo", have["url"], repo))
        cmds.append(f"git -C {q(src)} remote set-url origin {q(repo)}")
    change = ctx.change(ROLE, "source", "update", "pin moved" if have["head"] != commit
                        else "origin changed", diffs)
    if commit is None:
        return Step(change, deferred=True)
    if not have.get("has_commit") or have["url"] != repo:
        cmds.append(f"git -C {q(src)} fetch --quiet --tags origin")
    cmds.append(f"git -C {q(src)} -c advice.detachedHead=false checkout --quiet --force --detach {commit}")
    return Step(change, cmds)


def build_script(ctx: HostContext, key: str) -> str:
    cluster, host = ctx.cluster, ctx.host
    p = paths(ctx.prefix)
    b = cluster.llama_cpp.build
    commit = ctx.resolved.commit
    number = ctx.resolved.build_number
    tree = f"{p['build']}/{host.backend}-{flavour(cluster, host)}"
    out = f"{p['builds']}/{key}"
    wanted = targets(cluster, host)
    jobs = str(b.jobs) if b.jobs else "$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu)"
    env = f"export CCACHE_DIR={q(b.ccache_dir)}; " if (b.ccache and b.ccache_dir) else ""
    number_expr = str(number) if number is not None else f"$(git -C {q(p['src'])} rev-list --count HEAD)"
    flags = " ".join(q(f) for f in cmake_flags(cluster, host))
    rpc_pick = " ".join(d.llama_cpp_rpc_targets)
    lines = [
        "set -e", env.strip() or ":",
        f"SRC={q(p['src'])}; TREE={q(tree)}; OUT={q(out)}",
        'mkdir -p "$TREE" "${OUT%/*}"',
        f'[ "$(git -C "$SRC" rev-parse HEAD)" = {commit} ] || '
        f'{{ echo "source is not at {commit[:12]}" >&2; exit 1; }}',
        # The worker's target name changed upstream; ask the tree which one it has.
        "RPC=''; for t in " + rpc_pick + "; do "
        "grep -rqs --include=CMakeLists.txt \"set(TARGET $t)\" \"$SRC/tools/rpc\" \"$SRC/examples/rpc\" "
        "&& { RPC=$t; break; }; done",
        "TARGETS=''",
    ]
    if d.llama_cpp_server_target in wanted:
        lines.append(f"TARGETS={d.llama_cpp_server_target}")
    if "rpc" in wanted:
        lines.append('[ -n "$RPC" ] || { echo "no RPC worker target in this llama.cpp tree" >&2; exit 1; }')
        lines.append('TARGETS="$TARGETS $RPC"')
    lines += [
        f"cmake -S \"$SRC\" -B \"$TREE\" -G Ninja {flags} -DLLAMA_BUILD_NUMBER={number_expr} "
        f"-DLLAMA_BUILD_COMMIT={commit[:7]} > \"$TREE.configure.log\" 2>&1 || "
        "{ tail -n 30 \"$TREE.configure.log\" >&2; exit 1; }",
        f"cmake --build \"$TREE\" --target $TARGETS -j {jobs} > \"$TREE.build.log\" 2>&1 || "
        "{ tail -n 40 \"$TREE.build.log\" >&2; exit 1; }",
        'rm -rf "$OUT.tmp"; mkdir -p "$OUT.tmp/bin"',
        'for t in $TARGETS; do cp "$TREE/bin/$t" "$OUT.tmp/bin/"; done',
        # Binaries must run before they can become current.
        f'if [ -x "$OUT.tmp/bin/{d.llama_cpp_server_target}" ]; then '
        f'"$OUT.tmp/bin/{d.llama_cpp_server_target}" --help > "$OUT.tmp/llama-server.help" 2>&1; fi',
        'if [ -n "$RPC" ] && [ -x "$OUT.tmp/bin/$RPC" ]; then "$OUT.tmp/bin/$RPC" --help > "$OUT.tmp/rpc-server.help" 2>&1; fi',
        'PROTO=$(awk \'/define RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION/ {printf "%s%s", s, $3; s="."}\' '
        '"$SRC/ggml/include/ggml-rpc.h" 2>/dev/null)',
        f"printf 'commit=%s\\nbackend=%s\\nkey=%s\\nrpc_binary=%s\\ntargets=%s\\nproto=%s\\n' "
        f"{commit} {host.backend} {key} \"$RPC\" \"$TARGETS\" \"$PROTO\" > \"$OUT.tmp/manifest\"",
        'rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"',
    ]
    return "\n".join(lines)


def activate_script(ctx: HostContext, key: str) -> str:
    """Flip `current` atomically and prune old builds beyond keep_builds (never the current)."""
    p = paths(ctx.prefix)
    keep = ctx.cluster.llama_cpp.keep_builds
    return "\n".join([
        "set -e",
        f"ln -sfn {d.llama_cpp_builds_dir}/{key} {q(p['current'])}.tmp && "
        f"mv -Tf {q(p['current'])}.tmp {q(p['current'])}",
        f"cd {q(p['builds'])} && ls -1t | grep -vx {q(key)} | grep -v '\\.tmp$' | "
        f"tail -n +{keep + 1} | while read -r old; do rm -rf \"$old\"; done",
    ])


def build(ctx: HostContext) -> Step:
    """llama_cpp.build: compile llama-server and the RPC worker for this host's backend."""
    cluster, host, commit = ctx.cluster, ctx.host, ctx.resolved.commit
    if not targets(cluster, host):
        return Step(ctx.change(ROLE, "build", "no-op", "host runs no llama.cpp binary"))
    have = ctx.fact("llama_cpp.Builds") or {"current": None, "builds": {}}
    current = have.get("current")
    current_commit = (have["builds"].get(current) or {}).get("commit") if current else None
    if commit is None:
        ctx.run["build_changed"] = True
        return Step(ctx.change(ROLE, "build", "replace" if current else "create",
                               "ref not resolved yet",
                               [AttrDiff("commit", current_commit and current_commit[:12], None,
                                         forces_replacement=bool(current), known_after_apply=True)]),
                    deferred=True)
    key = build_key(cluster, host, commit)
    ctx.run["build_key"] = key
    if key in have["builds"]:
        if current == key:
            return Step(ctx.change(ROLE, "build", "no-op", f"{key} built and current"))
        ctx.run["build_changed"] = True
        return Step(ctx.change(ROLE, "build", "update", "switch to an existing build (no compile)",
                               [AttrDiff("current", current, key)]),
                    [activate_script(ctx, key)])
    ctx.run["build_changed"] = True
    diffs = [AttrDiff("commit", current_commit and current_commit[:12], commit[:12],
                      forces_replacement=bool(current)),
             AttrDiff("backend", None if current else None, host.backend),
             AttrDiff("targets", None, " ".join(targets(cluster, host)))]
    return Step(ctx.change(ROLE, "build", "replace" if current else "create",
                           f"no build of {commit[:12]} for {host.backend} with these flags", diffs),
                [build_script(ctx, key), activate_script(ctx, key)])


def manifest_for(ctx: HostContext) -> dict | None:
    """The manifest of the build this host will run, when it is already installed."""
    key = ctx.run.get("build_key")
    builds = (ctx.fact("llama_cpp.Builds") or {}).get("builds", {})
    return builds.get(key) if key else None
