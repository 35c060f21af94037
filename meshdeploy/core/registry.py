"""The role registry: the one list of what meshdeploy manages.

Every role folder under meshdeploy/roles/ declares one `ROLE = Role(...)` in its role.py:
its resources in apply order, the facts each host's probe gathers for it, which of those move on
their own (volatile), the cluster-wide values it resolves before planning, and where it sits
relative to other roles. The engine, apply, the probe, the fixture tests and the docs iterate
this registry; adding a resource is an edit of its role's folder and nothing else.

A role's folder may also hold `schema.json`: the JSON Schema of a top-level section of the
cluster file named after the role. config/schema.py merges it into the cluster file's schema
(so its errors point at file:line:col like any other), the typed Cluster keeps the section's
data in `sections`, and the role reads it as its own typed settings (`ctx.section(name)`).
What the schema cannot express the role checks itself in cluster_file.py (file_hooks: run by
core.loading with the config layer's checks, without importing role.py). Its `status` hook
adds its lines to `meshdeploy status` (StatusProbe, StatusRow).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshdeploy.config.document import Document
    from meshdeploy.config.model import Cluster, Host
    from meshdeploy.core.context import HostContext, Resolved, Step, Teardown
    from meshdeploy.core.probe import Section
    from meshdeploy.errors import ConfigIssue


@dataclass(frozen=True)
class FactRequest:
    """What a role needs to say which facts a host's probe gathers for it."""

    cluster: Cluster
    host: Host
    first: bool  # the host that resolves cluster-wide values (resolver())
    # The host is to be destroyed (it left the file, or `meshdeploy destroy`): a role adds
    # the facts its destroy hook reads (what it stored there, and how big it is).
    destroying: bool = False


@dataclass(frozen=True)
class Prepare:
    """The inputs of a role's cluster-wide preparation, run once before any step is planned."""

    cluster: Cluster
    hosts: Sequence[Host]
    facts: dict  # host name -> {section key: decoded fact}
    resolved: Resolved  # what earlier roles resolved
    header_cache: Any = None  # a control-machine folder for GGUF headers (pathlib.Path)
    read_remote: Callable | None = None  # (host, path, reader) -> bytes over the plan's SSH
    # Measured device speeds kept on the control machine (engine.speeds): server name -> entry.
    speeds: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Prepared:
    """A role's contribution: the values it fixes for the run (its own type, kept under its name
    in Resolved), plan warnings, and the plan's typed sections it knows how to fill."""

    values: Any = None
    # The llama.cpp commit the run builds and where it came from ("lock file", "ls-remote on
    # HOST"): the plan's header; None from a role that does not pin it.
    commit: tuple[str | None, str] | None = None
    warnings: tuple[str, ...] = ()
    placement: tuple = ()  # core.plan.Placement sections for the plan's views
    network: tuple = ()  # core.plan.Network rows: measured links and their cost per token
    # What the plan's Hosts table says of a host in the role's column: (host, column, text),
    # column one of core.plan.HostAccess's ("manager", "protection").
    access: tuple = ()


@dataclass(frozen=True)
class Check:
    """The inputs of a role's check across hosts, run once every host passed its preflight."""

    cluster: Cluster
    hosts: Sequence[Host]  # the hosts this run plans (--limit leaves some out)
    facts: dict  # host name -> {section key: decoded fact}
    resolved: Resolved  # every role's prepared values
    limit: Sequence[str] = ()  # the --limit patterns; empty when the run plans every host


@dataclass(frozen=True)
class Resource:
    """One kind of thing a role manages on every host (one pyinfra operation per instance, or
    one for all its instances: `together`).

    plan(ctx, key) -> Step is evaluated by `plan` from the probe's facts and again by `apply`
    at execution time, when earlier steps have run.
    """

    name: str  # short, unique in its role: "build", "gguf", "rpc_server"
    plan: Callable[[HostContext, Any], Step]
    doc: str
    # The instances: one per key (model names, ports, server names); None = one per host.
    keys: Callable[[Cluster], Sequence] | None = None
    # Facts re-read on a host, once, before this resource when an earlier resource ran there:
    # ((earlier resource, section key), ...), e.g. a new build's manifest.
    rereads: tuple[tuple[str, str], ...] = ()
    # Re-read `rereads` on every host where the earlier resource ran, as a cluster-wide
    # resource does, for a plan that reads other hosts' facts when it has them (llama_cpp.copy:
    # the builder's tarball sha256) and plans alone without them.
    rereads_peers: bool = False
    # True when the plan of one host needs every host's facts (placement, seeds): a pyinfra
    # deploy that calls the operation on its own is refused.
    cluster_wide: bool = False
    # Run on one host at a time (pyinfra's _serial) when the cluster file asks for it.
    serial: Callable[[Cluster], bool] | None = None
    # Only apply schedules it (it acts on what earlier operations did; a plan shows nothing).
    apply_only: bool = False
    # `-replace=ADDRESS` may name it: its plan reads ctx.replacing() and answers `-/+`.
    replaceable: bool = False
    # Resources of roles that come earlier in the registry that this one must still precede
    # ("models.gguf"): it runs just before the first of them, ahead of its role's place (where
    # none is registered, in its place). For a resource that only needs what those roles'
    # predecessors made, and that their steps need.
    runs_before: tuple[str, ...] = ()
    # A keyed resource whose instances never wait on another host's instance of it (a server's
    # health, an rpc-server's port): True, apply runs all its instances as one operation, each
    # host its own while the others run theirs. For one whose instance serves the same instance
    # elsewhere (models.gguf: a host copies model M from the host that fetches M in its own
    # models.gguf[M], so both must run [M] at once), the hosts an instance runs on,
    # (cluster, key) -> host names: consecutive keys whose hosts do not meet are one operation
    # (each host runs at most one of them), the others one operation each.
    together: bool | Callable[[Cluster, Any], Iterable[str]] = False
    # What `-target` brings along with it (engine.targets): these resources (qualified names,
    # each earlier in apply order) on its host; when cluster_wide, those and itself on every
    # host (its plan reads its peers', as a tunnel's ends must agree); None: every
    # resource before it and itself on every host, for one whose plan reads what any of them did
    # or that uses the same instance on another host (a copy).
    needs: tuple[str, ...] | None = None
    role: str = ""  # filled by Role

    @property
    def qualified(self) -> str:
        return f"{self.role}.{self.name}"

    def slot(self, key) -> str:
        return self.qualified if key is None else f"{self.qualified}[{key}]"


@dataclass(frozen=True)
class LogSource:
    """One service's log on one host, as `meshdeploy logs` reads it."""

    host: str  # host name
    service: str  # how output lines name it: "rpc-server:50052", "llama-server:main"
    unit: str  # the systemd unit
    launchd_log: str  # the log file the service writes on macOS
    names: frozenset[str]  # every word that selects it: kind, server name, unit, host:port


@dataclass(frozen=True)
class StatusRow:
    """One line of `meshdeploy status` on a host: what runs there and how it answers."""

    service: str  # "rpc-server :50052", "motd"
    unit: str  # the unit's state ("active"), or what stands for it
    answer: str
    healthy: bool  # False makes `meshdeploy status` exit 1, like a service that is down
    protocol: str | None = None
    model: str | None = None


@dataclass(frozen=True)
class StatusProbe:
    """A role's part of a host's status script: `script` (built through core/shell.py; run as
    the login user, in a subshell of its own) prints lines, and `parse` turns exactly those
    lines into the role's rows."""

    script: str
    parse: Callable[[list[str]], list[StatusRow]]


@dataclass(frozen=True)
class Role:
    name: str
    doc: str
    resources: tuple[Resource, ...]
    facts: Callable[[FactRequest], list[Section]]
    # Fact keys (section-key prefixes) whose values move on their own (free disk, memory,
    # round trips): kept out of the drift fingerprint.
    volatile: tuple[str, ...] = ()
    prepare: Callable[[Prepare], Prepared] | None = None
    # Per-host check before anything changes (raises PlanError naming the host).
    preflight: Callable[[HostContext], None] | None = None
    # Across hosts, once every host passed preflight: the plan's warnings about what differs
    # between hosts (builds of different commits); raises PlanError to refuse the run (a
    # --limit that would leave hosts on different commits).
    check: Callable[[Check], tuple[str, ...]] | None = None
    # Control-machine files besides the cluster file that a plan is computed from (a saved
    # plan is stale when they change).
    inputs: Callable[[Cluster], list] | None = None
    # Called once when apply starts, before any host changes (e.g. recording a resolved ref).
    apply_started: Callable[[Cluster, Resolved], None] | None = None
    # Its lines of `meshdeploy status` on a host (None: nothing on that host).
    status: Callable[[Cluster, Host], StatusProbe | None] | None = None
    # The logs of the services the role runs (meshdeploy logs), hosts in file order.
    logs: Callable[[Cluster], list[LogSource]] | None = None
    # (HostContext, purge) -> Teardown: remove everything of this role on a host that leaves
    # the cluster (units stopped, disabled and deleted; rules and tunnels removed); the
    # expensive bytes only when purge is true. Run in reverse registry order, from the facts
    # gathered with FactRequest.destroying; never touches the toolchain's packages.
    destroy: Callable[[HostContext, bool], Teardown] | None = None
    after: tuple[str, ...] = ()  # roles whose resources run before this role's
    before: tuple[str, ...] = ()  # roles whose resources run after this role's
    # Addresses or networks outside the cluster that the role's own service reaches every
    # meshdeploy port from (Prometheus's scrapers), as the file writes them: the network role's
    # allow-lists and the services' units let them in (admitted()).
    admits: Callable[[Cluster], Sequence[str]] | None = None

    def __post_init__(self):
        bound = tuple(Resource(**{**r.__dict__, "role": self.name}) for r in self.resources)
        object.__setattr__(self, "resources", bound)

    def resource(self, name: str) -> Resource:
        for r in self.resources:
            if r.name == name:
                return r
        raise KeyError(f"{self.name} has no resource {name!r}")


@dataclass(frozen=True)
class Slot:
    """One resource instance in apply order: the same sequence on every host (pyinfra #1370)."""

    name: str  # "models.gguf[gemma]"
    resource: Resource
    key: Any = None


class RegistryError(Exception):
    pass


def resolver(hosts: Sequence[Host]) -> str | None:
    """The host that resolves cluster-wide values for a run over `hosts` (the llama.cpp ref, by
    git ls-remote: the commit every host compiles and runs): the first host with root in file
    order, so that a rootless host's login user, whom a root host must not trust, never chooses
    what root hosts run; the first host when every host is rootless."""
    for host in hosts:
        if not host.rootless:
            return host.name
    return hosts[0].name if hosts else None


@cache
def roles() -> tuple[Role, ...]:
    """Every role under meshdeploy.roles (each folder's role.py), in dependency order (ties: by
    name)."""
    found: dict[str, Role] = {}
    for name in _folders():
        module = _module(name, "role")
        role = getattr(module, "ROLE", None) if module else None
        if isinstance(role, Role):
            if role.name != name:
                raise RegistryError(f"roles/{name} declares role {role.name!r}")
            found[role.name] = role
    return tuple(_ordered(found))


def _folders() -> list[str]:
    import meshdeploy.roles as package

    return [info.name for info in pkgutil.iter_modules(package.__path__) if info.ispkg]


def _module(role: str, name: str) -> ModuleType | None:
    """meshdeploy.roles.<role>.<name>, or None where the role has no such module."""
    qualified = f"meshdeploy.roles.{role}.{name}"
    if importlib.util.find_spec(qualified) is None:
        return None
    return importlib.import_module(qualified)


@cache
def file_hooks() -> tuple[ModuleType, ...]:
    """Each role's part in loading a cluster file: the folder's cluster_file.py, whose
    `complete(cluster) -> Cluster` puts what the role's section decides for other layers on the
    typed cluster (the network role: the Network every layer reads, the rpc-servers' binds), and
    whose `validate(doc, cluster) -> [ConfigIssue]` checks what the role's schema.json cannot
    express, at file:line:col. Imported without role.py: a role's package imports nothing, so
    `validate` reads no operation, fact or pyinfra. Folders in name order."""
    return tuple(m for m in (_module(name, "cluster_file") for name in sorted(_folders())) if m)


def completed(cluster: Cluster) -> Cluster:
    """`cluster` with every role's `complete` applied, in file_hooks order."""
    for module in file_hooks():
        if hasattr(module, "complete"):
            cluster = module.complete(cluster)
    return cluster


def validations(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    """Every role's checks of its own section (cluster_file.validate)."""
    return [i for m in file_hooks() if hasattr(m, "validate") for i in m.validate(doc, cluster)]


def file_warnings(cluster: Cluster) -> list[str]:
    """Every role's risks of its settings, said at every validate, plan and apply
    (cluster_file.warnings)."""
    return [w for m in file_hooks() if hasattr(m, "warnings") for w in m.warnings(cluster)]


def _ordered(found: dict[str, Role]) -> list[Role]:
    edges = {name: set() for name in found}  # name -> roles that must come first
    for role in found.values():
        for other in role.after:
            if other in found:
                edges[role.name].add(other)
        for other in role.before:
            if other in found:
                edges[other].add(role.name)
    out: list[Role] = []
    done: set[str] = set()
    while len(out) < len(found):
        ready = sorted(n for n in found if n not in done and edges[n] <= done)
        if not ready:
            raise RegistryError("roles depend on each other in a circle: "
                                + ", ".join(sorted(set(found) - done)))
        out.append(found[ready[0]])
        done.add(ready[0])
    return out


def role(name: str) -> Role:
    for r in roles():
        if r.name == name:
            return r
    raise KeyError(name)


def resources() -> tuple[Resource, ...]:
    """Every resource in apply order: role by role, each role's in its own order, except that a
    resource with runs_before moves to just before the first resource it names."""
    out = [r for role_ in roles() for r in role_.resources]
    for moved in [r for r in out if r.runs_before]:
        ahead = [i for i, r in enumerate(out) if r.qualified in moved.runs_before]
        if ahead and out.index(moved) > min(ahead):
            out.remove(moved)
            out.insert(min(ahead), moved)
    return tuple(out)


def resource(qualified: str) -> Resource:
    name, _, short = qualified.partition(".")
    return role(name).resource(short)


def slots(cluster: Cluster, apply: bool = False) -> list[Slot]:
    """Every resource instance in apply order; every host gets all of them. A plan leaves out
    the apply-only resources."""
    out = []
    for r in resources():
        if r.apply_only and not apply:
            continue
        keys = [None] if r.keys is None else list(r.keys(cluster))
        out += [Slot(r.slot(k), r, k) for k in keys]
    return out


def sections(request: FactRequest) -> list[Section]:
    """Every fact the host's plan reads, role by role."""
    return [s for role_ in roles() for s in role_.facts(request)]


def checks(request: Check) -> list[str]:
    """Every role's check across hosts, in registry order: the warnings they return."""
    return [w for role_ in roles() if role_.check for w in role_.check(request)]


def admitted(cluster: Cluster) -> tuple[str, ...]:
    """The addresses and networks the roles' services reach the cluster's ports from (Role.admits),
    each once, in registry order."""
    out: list[str] = []
    for role_ in roles():
        for value in role_.admits(cluster) if role_.admits else ():
            if value not in out:
                out.append(value)
    return tuple(out)


def log_sources(cluster: Cluster) -> list[LogSource]:
    """Every service log of the cluster, role by role."""
    return [s for role_ in roles() if role_.logs for s in role_.logs(cluster)]


def status_probes(cluster: Cluster, host: Host) -> list[tuple[str, StatusProbe]]:
    """(role name, its status probe) of every role with status lines on the host."""
    found = [(role_.name, role_.status(cluster, host)) for role_ in roles() if role_.status]
    return [(name, probe) for name, probe in found if probe is not None]


def volatile() -> tuple[str, ...]:
    return tuple(v for role_ in roles() for v in role_.volatile)
