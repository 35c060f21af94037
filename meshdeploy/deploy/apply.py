"""Apply: the planned steps as pyinfra operations, in order, with readiness checks and a summary."""

from __future__ import annotations

import time
from dataclasses import replace

from meshdeploy.deploy.context import HostContext, Step, Upload
from meshdeploy.deploy.engine import Planned, Session, slots
from meshdeploy.deploy.errors import ApplyError
from meshdeploy.roles.llama_cpp import lock as locks
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.llama_cpp.facts import Builds, ls_remote, pick_ls_remote

RESOLVE_SLOT = "llama_cpp.resolve"
# Slots whose steps read the build's manifest: re-read it once the build changed.
_NEEDS_MANIFEST = ("services.rpc_server", "services.llama_server")


class Run:
    """What apply shares between the operations of all hosts while they execute."""

    def __init__(self, session: Session, planned: Planned, progress):
        self.session = session
        self.cluster = session.cluster
        self.resolved = replace(planned.resolved, restarted=set(), models=dict(planned.resolved.models))
        self.contexts = {h.name: HostContext(self.cluster, h, dict(planned.facts[h.name]), self.resolved)
                         for h in session.hosts()}
        self.functions = dict(slots(self.cluster))
        self.results: list[dict] = []
        self.failure: dict | None = None
        self.progress = progress
        self.started: dict = {}

    def step(self, host_name: str, slot: str) -> Step:
        ctx = self.contexts[host_name]
        if slot == RESOLVE_SLOT:
            return self.resolve_step(ctx)
        if slot.startswith(_NEEDS_MANIFEST) and ctx.run.get("build_changed") and \
                not ctx.run.get("manifest_refreshed"):
            p = llama_cpp.paths(ctx.prefix)
            host = self.session.pyhosts[host_name]
            ctx.facts["llama_cpp.Builds"] = host.get_fact(
                Builds, builds_dir=p["builds"], current_link=p["current"])
            ctx.run["manifest_refreshed"] = True
        return self.functions[slot](ctx)

    def resolve_step(self, ctx: HostContext) -> Step:
        """Resolve the ref on the first host once git is there; record it in the lock file."""
        first = self.session.hosts()[0].name
        change = ctx.change("llama_cpp", "resolve", "no-op", "ref already resolved")
        if self.resolved.commit is not None or ctx.host.name != first:
            return Step(change)
        ref, repo = self.cluster.llama_cpp.ref, self.cluster.llama_cpp.repo
        # As the login user: resolving a ref needs no root, and the repository is a value.
        ok, output = self.session.run(first, ls_remote(repo, ref), sudo=False)
        commit = pick_ls_remote(output.stdout_lines) if ok else None
        if not commit:
            raise ApplyError(f"{first}: llama_cpp.ref {ref!r} does not exist in {repo}",
                             hint="use a tag, branch or full commit of that repository")
        self.resolved.commit = commit
        locks.write_lock(self.cluster.path, repo, ref, commit)
        return Step(ctx.change("llama_cpp", "resolve", "no-op", f"{ref} -> {commit[:12]}"))


def _operation(run: Run):
    import io

    from pyinfra import host
    from pyinfra.api import FileUploadCommand, StringCommand, operation

    @operation(is_idempotent=True)
    def meshdeploy_step(slot: str):
        name = host.name
        try:
            step = run.step(name, slot)
        except Exception as exc:
            run.failure = {"host": name, "step": slot, "error": exc}
            raise
        if step.noop:
            host.noop(step.change.reason)
            return
        run.started[(name, slot)] = time.monotonic()
        for command in step.commands:
            kwargs = {} if step.sudo else {"_sudo": False}
            if isinstance(command, Upload):
                yield FileUploadCommand(io.StringIO(command.content), command.path, **kwargs)
            else:
                yield StringCommand(command, **kwargs)

    return meshdeploy_step


def record_lock(cluster, planned: Planned) -> None:
    """A ref this plan resolved is recorded before any host builds it."""
    if planned.resolved.commit and planned.plan.commit_source.startswith("ls-remote"):
        locks.write_lock(cluster.path, cluster.llama_cpp.repo, cluster.llama_cpp.ref,
                         planned.resolved.commit)


def apply(session: Session, planned: Planned, progress=print) -> list[dict]:
    from pyinfra.api import BaseStateCallback
    from pyinfra.api.operation import add_op
    from pyinfra.api.operations import run_ops
    from pyinfra.api.state import StateStage

    run = Run(session, planned, progress)
    state = session.state
    op = _operation(run)
    order = [slot for slot, _ in slots(session.cluster)]
    if planned.resolved.commit is None:
        order.insert(order.index("llama_cpp.source"), RESOLVE_SLOT)

    class Progress(BaseStateCallback):
        @staticmethod
        def operation_host_success(state, host, op_hash, retry_count=0):
            _record(run, state, host, op_hash, "ok")

        @staticmethod
        def operation_host_error(state, host, op_hash, retry_count=0, max_retries=0):
            _record(run, state, host, op_hash, "failed")

    state.add_callback_handler(Progress())
    state.set_stage(StateStage.Prepare)
    metas = {}
    for slot in order:
        kwargs = {"name": slot}
        if slot == "llama_cpp.build" and session.cluster.llama_cpp.build.serial:
            kwargs["_serial"] = True
        metas[slot] = add_op(state, op, slot, **kwargs)
    state.set_stage(StateStage.Execute)
    try:
        run_ops(state)
    except Exception as exc:  # pyinfra raises once too many hosts failed
        if run.failure is None and not _failed(metas):
            raise ApplyError(f"apply stopped: {exc}") from None
    failed = _failed(metas)
    if run.failure and isinstance(run.failure["error"], Exception) and not failed:
        raise run.failure["error"]
    if failed:
        host_name, slot, meta = failed[0]
        err = run.failure["error"] if run.failure else None
        if err is not None and hasattr(err, "hint"):
            raise err
        lines = [line for line in _stderr(meta) if line.strip()][-25:]
        detail = "\n".join("    " + line for line in lines) or "    (no output)"
        raise ApplyError(f"{host_name}: {slot} failed:\n{detail}",
                         hint="fix the cause shown above, then run apply again: finished steps "
                              "are not repeated")
    return run.results


def _failed(metas):
    out = []
    for slot, per_host in metas.items():
        for host, meta in per_host.items():
            try:
                if meta.did_error():
                    out.append((host.name, slot, meta))
            except Exception:
                continue
    return out


def _stderr(meta) -> list[str]:
    try:
        return list(meta.stderr_lines) or list(meta.stdout_lines)
    except Exception:
        return []


def _record(run: Run, state, host, op_hash, status):
    names = state.get_op_meta(op_hash).names
    slot = next(iter(names)) if names else op_hash
    started = run.started.pop((host.name, slot), None)
    if started is None and status == "ok":
        return  # a no-op: the summary lists only what ran
    seconds = time.monotonic() - started if started else 0.0
    row = {"host": host.name, "step": slot, "status": status, "detail": f"{seconds:.1f} s"}
    run.results.append(row)
    if run.progress:
        run.progress(f"  {host.name:<12} {slot:<32} {status} ({seconds:.1f} s)")
