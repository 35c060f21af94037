"""One llama.cpp everywhere (the role's check across hosts, Role.check).

The RPC handshake only compares protocol majors; op-table drift between commits goes unnoticed
and corrupts results, so every host must run the same commit. The plan shows what each host
runs now, refuses a partial (--limit) move of the commit, and warns about drift it will fix.
"""

from __future__ import annotations

from meshdeploy.core.registry import Check
from meshdeploy.errors import PlanError
from meshdeploy.roles.llama_cpp import run


def running(cluster, hosts, facts) -> dict[str, tuple[str, str]]:
    """host -> (commit, RPC protocol) of its current build, for hosts that have one."""
    out = {}
    for h in hosts:
        if not cluster.runs_llama_cpp(h):
            continue
        builds = (facts.get(h.name) or {}).get("llama_cpp.Builds") or {}
        current = builds.get("current")
        manifest = (builds.get("builds") or {}).get(current) if current else None
        if manifest and manifest.get("commit"):
            out[h.name] = (manifest["commit"], manifest.get("proto") or "?")
    return out


def check(request: Check) -> tuple[str, ...]:
    """Warnings about drift; PlanError when --limit would leave hosts on different commits."""
    cluster, hosts, limit = request.cluster, request.hosts, request.limit
    commit = run.of(request.resolved).commit
    now = running(cluster, hosts, request.facts)
    if limit and commit:
        moving = sorted(h for h, (c, _) in now.items() if c != commit)
        fresh = sorted(h.name for h in hosts if cluster.runs_llama_cpp(h) and h.name not in now)
        if moving or fresh:
            raise PlanError(
                f"--limit {','.join(limit)} would move {', '.join(moving + fresh)} to llama.cpp "
                f"{commit[:12]} while the other hosts keep what they run: every host must run the "
                "same commit (RPC breaks across versions)",
                hint="plan and apply without --limit to move the whole cluster")
    commits = {c for c, _ in now.values()}
    if len(commits) > 1:
        listing = ", ".join(f"{h} {c[:12]} (RPC {p})" for h, (c, p) in sorted(now.items()))
        target = f" apply moves every host to {commit[:12]}" if commit else ""
        return (f"hosts run different llama.cpp builds: {listing};{target}",)
    return ()
