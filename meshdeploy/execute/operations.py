"""Every registered resource as a named pyinfra operation (`llama_cpp.build`, `models.gguf`).

Inside `meshdeploy apply` an operation asks the running apply for its step (facts from the one
batched probe per host, what earlier steps decided). Called from a user's own pyinfra deploy with
`cluster=` (docs/examples/deploy.py), it probes its host once, plans every earlier resource of
that host from those facts, and runs its own step: the same code, on pyinfra's terms.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache
from pathlib import Path

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import probe, registry
from meshdeploy.core.context import HostContext, SecretStdin, Step, Steps
from meshdeploy.engine import planner as engine
from meshdeploy.errors import PlanError

_active = None  # the apply.Run executing, while `meshdeploy apply` runs pyinfra


@contextmanager
def running(run):
    """Route the operations to `run` while pyinfra executes them."""
    global _active
    previous, _active = _active, run
    try:
        yield
    finally:
        _active = previous


@cache
def operation_for(resource):
    """A pyinfra operation named after the resource: pyinfra's output, logs and --debug say
    `llama_cpp.build`, and a deploy file can call it."""
    from pyinfra import host
    from pyinfra.api import operation

    def body(key=None, cluster: str | None = None):
        if _active is not None and cluster is None and _active.stopping():
            host.noop("not started: apply interrupted")
            return
        if _active is not None and cluster is None:
            step = _active.step(host.name, resource, key)
        else:
            step = standalone_step(resource, host, key, cluster)
        if step.noop:
            host.noop(step.change.reason)
            return
        if _active is not None and cluster is None:
            _active.begin(host.name, resource.slot(key))
        yield from commands(step)

    body.__name__ = body.__qualname__ = resource.name
    body.__module__ = f"meshdeploy.roles.{resource.role}"
    body.__doc__ = f"{resource.qualified}: {resource.doc}"
    return operation(is_idempotent=True)(body)


@cache
def keyed_operation_for(resource):
    """Every instance of a `together` resource (`services.llama_server[main]`, `[second]`) as
    one operation of `meshdeploy apply`: each host runs its own instances in the file's order
    while the other hosts run theirs. One operation per instance kept a host waiting for another
    host's instance of another key: three servers on three hosts waited for health in turn."""
    from pyinfra import host
    from pyinfra.api import operation

    def body(keys=()):
        ran = False
        for key in keys:
            if _active.stopping():
                host.noop("not started: apply interrupted")
                return
            step = _active.step(host.name, resource, key)
            if step.noop:
                continue
            ran = True
            _active.begin(host.name, resource.slot(key))
            yield from commands(step)
            _active.finish(host.name, resource.slot(key), "ok")
        if not ran:
            host.noop("nothing to do")

    body.__name__ = body.__qualname__ = resource.name
    body.__module__ = f"meshdeploy.roles.{resource.role}"
    body.__doc__ = f"{resource.qualified}: {resource.doc}"
    return operation(is_idempotent=True)(body)


@cache
def teardown_for(role: str):
    """`<role>.destroy` as a pyinfra operation: the role's planned destroy steps on a host that
    leaves the cluster, a no-op on the others."""
    from pyinfra import host
    from pyinfra.api import operation

    def body():
        if _active is not None and _active.stopping():
            host.noop("not started: apply interrupted")
            return
        steps = _active.teardown_steps(host.name, role) if _active is not None else []
        if not steps:
            host.noop("stays in the cluster")
            return
        _active.begin(host.name, f"{role}.destroy")
        for step in steps:
            yield from commands(step)
        _active.destroyed.add((host.name, role))

    body.__name__ = body.__qualname__ = "destroy"
    body.__module__ = f"meshdeploy.roles.{role}"
    body.__doc__ = f"{role}.destroy: what the role put on a host that leaves the cluster"
    return operation(is_idempotent=True)(body)


def commands(step: Step):
    """The step's commands as pyinfra commands; a SecretStdin's secret goes to the command's
    standard input over the SSH channel (pyinfra's _stdin), never through a file."""
    from pyinfra.api import StringCommand

    kwargs = {} if step.sudo else {"_sudo": False}
    for command in step.commands:
        if isinstance(command, SecretStdin):
            yield StringCommand(str(command), _stdin=command.stdin, **kwargs)
        else:
            yield StringCommand(command, **kwargs)


def standalone_step(resource, pyhost, key, cluster_path) -> Step:
    """The step of `resource` on `pyhost` in a user's pyinfra deploy: one probe of the host, the
    roles' cluster-wide values for this host alone, every earlier resource planned from it."""
    from pyinfra.api import StringCommand

    if cluster_path is None:
        raise PlanError(f"{resource.qualified}: pass cluster=<the cluster file>",
                        hint="the operation plans from the file's description of the host")
    if resource.cluster_wide:
        raise PlanError(f"{resource.qualified} plans from every host's facts",
                        hint="run it through `meshdeploy apply`, which probes the whole cluster")
    cluster = load_cluster(Path(cluster_path))
    try:
        host = cluster.host(pyhost.name)
    except KeyError:
        raise PlanError(f"{cluster.path}: no host {pyhost.name!r} in the cluster file",
                        hint="name the pyinfra inventory's hosts as the cluster file does") from None
    nonce = probe.new_nonce()
    sections, script = engine.probe_command(cluster, host, True, nonce)
    ok, output = pyhost.run_shell_command(StringCommand(script), _sudo=False)
    if not ok:
        raise PlanError(f"{host.name}: the probe failed",
                        hint="\n".join(output.stderr_lines[-5:]) or None)
    facts = probe.decode(sections, probe.split(output.stdout_lines, sections, nonce))
    facts.pop("probe.SudoCheck", None)
    # Roles whose values need every host (placement) prepare nothing here.
    roles = [r for r in registry.roles() if not any(x.cluster_wide for x in r.resources)]
    resolved = engine.prepare(cluster, [host], {host.name: facts}, roles=roles).resolved
    steps = Steps()
    for slot in registry.slots(cluster):
        ctx = HostContext(cluster, host, facts, resolved, steps, first=True)
        if slot.resource is resource and slot.key == key:
            return resource.plan(ctx, key)
        if not slot.resource.cluster_wide:
            steps.add(host.name, slot.name, slot.resource.plan(ctx, slot.key))
    raise PlanError(f"{resource.slot(key)}: no such instance in {cluster.path}",
                    hint="pass a key the cluster file has (a model name, a port, a server name)")
