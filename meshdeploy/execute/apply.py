"""Apply: every registered resource as its named pyinfra operation, in order, with readiness
checks and a summary."""

from __future__ import annotations

import threading
import time

from meshdeploy.core import registry
from meshdeploy.core.context import HostContext, Step, Steps
from meshdeploy.core.plan import Change
from meshdeploy.engine.planner import Planned
from meshdeploy.errors import ApplyError
from meshdeploy.execute import operations
from meshdeploy.execute.interrupt import Interrupts
from meshdeploy.remote.session import Session


class Run:
    """What apply shares between the operations of all hosts while they execute: the facts
    (re-read where an earlier step changed them), the steps decided so far, the resolved values
    (a step may fix one, e.g. the commit), timings and the first failure."""

    def __init__(self, session: Session, planned: Planned, progress, reporter=None):
        self.session = session
        self.cluster = session.cluster
        self.resolved = planned.resolved
        self.facts = {h.name: dict(planned.facts[h.name]) for h in session.hosts()}
        self.first = registry.resolver(session.hosts())
        self.steps = Steps()
        self.reread: set[tuple[str, str]] = set()
        self.reread_lock = threading.Lock()
        self.results: list[dict] = []
        self.failure: dict | None = None
        self.progress = progress
        self.reporter = reporter  # live progress of the running steps (core/progress.py)
        self.started: dict = {}
        self.teardown = planned.teardown
        self.leaving = set(planned.leaving) | {h.name for h in session.departed}
        self.destroyed = planned.destroyed  # (host, role) whose destroy ran, filled as they end
        self.interrupts: Interrupts | None = None  # Ctrl-C while the operations run
        self.targeted = planned.targeted  # -target: the (host, slot) pairs to run; None: all
        self.last_begun: dict[str, str] = {}  # host -> the slot that began there last
        self.failed_as: dict[tuple[str, str], str] = {}  # (host, operation) -> failed slot

    def stopping(self) -> bool:
        """Ctrl-C came: no further step starts (the ones in flight finish or are stopped)."""
        return self.interrupts is not None and self.interrupts.stopping

    def step(self, host_name: str, resource: registry.Resource, key) -> Step:
        slot = resource.slot(key)
        if host_name in self.leaving:
            return Step(Change(host_name, resource.role, slot.partition(".")[2], "no-op",
                               reason="leaves the cluster"))
        if self.targeted is not None and (host_name, slot) not in self.targeted:
            return Step(Change(host_name, resource.role, slot.partition(".")[2], "no-op",
                               reason="not targeted (-target)"))
        try:
            self._reread(host_name, resource)
            host = self.cluster.host(host_name)
            ctx = HostContext(self.cluster, host, self.facts[host_name], self.resolved,
                              self.steps, first=host_name == self.first,
                              run_command=lambda command: self._run(host_name, command),
                              cluster_facts=self.facts,
                              failed_hosts=frozenset(h.name for h in
                                                     self.session.state.failed_hosts))
            step = resource.plan(ctx, key)
        except Exception as exc:
            self.failure = {"host": host_name, "step": slot, "error": exc}
            raise
        self.steps.add(host_name, slot, step)
        if step.resolves is not None:
            self.resolved = self.resolved.fixed(step.change.role, step.resolves)
        return step

    def teardown_steps(self, host_name: str, role: str) -> list[Step]:
        """The planned destroy steps of `role` on the host (none for a host that stays)."""
        return list(self.teardown.get((host_name, role), []))

    def begin(self, host_name: str, slot: str) -> None:
        self.started[(host_name, slot)] = time.monotonic()
        self.last_begun[host_name] = slot
        if self.reporter is not None:
            self.reporter.begin(host_name, slot)

    def finish(self, host_name: str, slot: str, status: str) -> None:
        """A step ended: its summary row (a no-op that never began has none)."""
        started = self.started.pop((host_name, slot), None)
        if self.reporter is not None:
            self.reporter.end(host_name, slot)
        if started is None and status == "ok":
            return  # a no-op: the summary lists only what ran
        seconds = time.monotonic() - started if started else 0.0
        self.results.append({"host": host_name, "step": slot, "status": status,
                             "detail": f"{seconds:.1f} s"})
        if self.progress:
            self.progress(f"  {host_name:<12} {slot:<32} {status} ({seconds:.1f} s)")

    def instance(self, host_name: str, name: str) -> str:
        """The slot an operation named `name` was running on the host when it failed: for the
        operation of a `together` resource (`services.llama_server`) the instance begun there
        and not finished (`services.llama_server[main]`), or the one whose plan failed."""
        slot = self.last_begun.get(host_name, "")
        if slot.startswith(f"{name}[") and (host_name, slot) in self.started:
            return slot
        failure = self.failure or {}
        if failure.get("host") == host_name and str(failure.get("step", "")).startswith(
                f"{name}["):
            return failure["step"]
        return name

    def _run(self, host_name: str, command: str) -> tuple[bool, list[str]]:
        ok, output = self.session.run(host_name, command, sudo=False)
        return ok, list(output.stdout_lines) if ok else []

    def _reread(self, host_name: str, resource: registry.Resource) -> None:
        """Facts the resource declares it re-reads once an earlier resource ran on the host; a
        cluster-wide resource re-reads them on every host where that resource ran (its plan
        reads them all, e.g. the peers' public keys), and so does one with rereads_peers."""
        everywhere = resource.cluster_wide or resource.rereads_peers
        hosts = [h.name for h in self.session.hosts()] if everywhere else [host_name]
        with self.reread_lock:  # the hosts' greenlets run one operation at once
            for name in hosts:
                for earlier, key in resource.rereads:
                    if (name, key) in self.reread or not self.steps.ran(name, earlier):
                        continue
                    request = registry.FactRequest(self.cluster, self.cluster.host(name),
                                                   name == self.first)
                    section = next(s for s in registry.sections(request) if s.key == key)
                    pyhost = self.session.pyhosts[name]
                    sudo = {"_sudo": True} if section.privileged and \
                        self.cluster.host(name).sudo else {}
                    self.facts[name][key] = pyhost.get_fact(section.fact, **section.kwargs,
                                                            **sudo)
                    self.reread.add((name, key))


def begin(cluster, planned: Planned) -> None:
    """Each role's apply_started hook, once the plan is made and before any host changes
    (llama_cpp records a ref the plan resolved in the lock file)."""
    for role in registry.roles():
        if role.apply_started is not None:
            role.apply_started(cluster, planned.resolved)


def apply(session: Session, planned: Planned, progress=print, slots: bool = True,
          ran: list | None = None, reporter=None) -> list[dict]:
    """Every slot on every host (unless slots is False: `meshdeploy destroy`), then each role's
    destroy on the hosts that leave, roles in reverse order. The hosts that stay converge first,
    so an orchestrator drops a departing worker from --rpc before that worker stops. `ran`, when
    given, receives the summary rows as steps end (also when apply fails or is interrupted).
    `reporter` (progress.Reporter) hears which step runs where and the steps' live progress
    lines."""
    from pyinfra.api import BaseStateCallback
    from pyinfra.api.operation import add_op
    from pyinfra.api.operations import run_ops
    from pyinfra.api.state import StateStage

    cluster = session.cluster
    run = Run(session, planned, progress, reporter)
    if ran is not None:
        run.results = ran
    state = session.state

    class Progress(BaseStateCallback):
        @staticmethod
        def operation_host_success(state, host, op_hash, retry_count=0):
            _record(run, state, host, op_hash, "ok")

        @staticmethod
        def operation_host_error(state, host, op_hash, retry_count=0, max_retries=0):
            _record(run, state, host, op_hash, "failed")

    state.add_callback_handler(Progress())
    state.set_stage(StateStage.Prepare)
    metas = []  # (operation name, its meta); a name may recur (models.gguf's runs of keys)
    for name, resource, key, keys in _operations(cluster) if slots else []:
        kwargs = {"_serial": True} if resource.serial and resource.serial(cluster) else {}
        if keys is None:
            metas.append((name, add_op(state, operations.operation_for(resource), key,
                                       name=name, **kwargs)))
        else:
            metas.append((name, add_op(state, operations.keyed_operation_for(resource),
                                       keys=keys, name=name, **kwargs)))
    for role in reversed(registry.roles()):
        if role.destroy is not None and any(r == role.name for _, r in planned.teardown):
            metas.append((f"{role.name}.destroy",
                          add_op(state, operations.teardown_for(role.name),
                                 name=f"{role.name}.destroy")))
    state.set_stage(StateStage.Execute)
    try:
        with operations.running(run), Interrupts(session, progress or print) as run.interrupts:
            run_ops(state)
    except Exception as exc:  # pyinfra raises once too many hosts failed
        if run.failure is None and not _failed(metas) and not run.stopping():
            raise ApplyError(f"apply stopped: {exc}") from None
    if run.stopping():
        raise run.interrupts.error(len(run.results))
    failed = _failed(metas)
    if run.failure and isinstance(run.failure["error"], Exception) and not failed:
        raise run.failure["error"]
    if failed:
        host_name, slot, meta = failed[0]
        err = run.failure["error"] if run.failure else None
        if err is not None and hasattr(err, "hint"):
            raise err
        parts = []
        for host_name, slot, meta in failed:  # every host's failure: one may explain another
            slot = run.failed_as.get((host_name, slot), slot)
            lines = [line for line in _stderr(meta) if line.strip()][-25:]
            detail = "\n".join("    " + line for line in lines) or (
                "    (no output: the SSH connection to it was lost; is the host up?)"
                if session.connection_lost(host_name) else "    (no output)")
            parts.append(f"{host_name}: {slot} failed:\n{detail}")
        raise ApplyError("\n".join(parts),
                         hint="fix the cause shown above, then run apply again: finished steps "
                              "are not repeated")
    return run.results


def _operations(cluster) -> list[tuple[str, registry.Resource, object, tuple | None]]:
    """The pyinfra operations apply adds, in order, as (name, resource, key, keys): one per
    slot (its key; None for a resource with one instance per host), except that the instances
    of a resource with `Resource.together` are one operation of all its keys
    (operations.keyed_operation_for: each host runs its own while the others run theirs), or,
    where `together` says which hosts each instance runs on, one operation of each run of
    consecutive keys whose hosts do not meet."""
    out: list[tuple[str, registry.Resource, object, tuple | None]] = []
    used: set[str] = set()  # the hosts of the last operation's keys
    for slot in registry.slots(cluster, apply=True):
        resource = slot.resource
        if resource.keys is None or not resource.together:
            out.append((slot.name, resource, slot.key, None))
            continue
        hosts = set(resource.together(cluster, slot.key)) if callable(resource.together) \
            else set()
        if out and out[-1][1] is resource and out[-1][3] is not None and not hosts & used:
            out[-1] = (*out[-1][:3], out[-1][3] + (slot.key,))
            used |= hosts
        else:
            out.append((resource.qualified, resource, None, (slot.key,)))
            used = hosts
    return out


def _failed(metas):
    out = []
    for slot, per_host in metas:
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
    name = next(iter(names)) if names else op_hash
    if status == "ok" and (host.name, name) not in run.started:
        return  # a no-op, or a keyed operation whose instances each recorded their end
    if status != "ok":
        run.failed_as[(host.name, name)] = name = run.instance(host.name, name)
    run.finish(host.name, name, status)
