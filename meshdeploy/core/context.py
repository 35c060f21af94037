"""What a role's planning functions see: the wish (cluster, host), the facts, and the run so far."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from meshdeploy.config.model import Cluster, Host
from meshdeploy.core import shell
from meshdeploy.core.plan import AttrDiff, Change, size_text


@dataclass(frozen=True)
class Resolved:
    """Values fixed once for the whole cluster before any host changes, each role's under the
    role's name: what its prepare hook returned (Prepared.values, an object of the role's own
    type; a step at apply may fix it again, Step.resolves), read back by the role itself as
    `resolved.of(ROLE)` and by the others attribute by attribute (`value`), as roles import no
    other role. `replace` is the run's own: the resource addresses `-replace=ADDRESS` names
    ("node2/network.wireguard", or "network.wireguard" for every host), checked against the
    registry by the engine.
    """

    roles: dict[str, Any] = field(default_factory=dict)
    replace: tuple[str, ...] = ()

    def of(self, role: str) -> Any:
        """The role's values (None where it fixed none: no prepare hook, or not run yet)."""
        return self.roles.get(role)

    def value(self, role: str, name: str, default: Any = None) -> Any:
        """One of another role's values by name, `default` where the role fixed none; a name
        its values do not have is an AttributeError, never the default."""
        values = self.roles.get(role)
        return default if values is None else getattr(values, name)

    def fixed(self, role: str, values: Any) -> Resolved:
        """This Resolved with `values` as the role's."""
        return replace(self, roles={**self.roles, role: values})


@dataclass(frozen=True)
class BuildOutcome:
    """What llama_cpp.build decided for one host: the build its services run."""

    key: str | None  # None: known after apply (the ref is not resolved yet)
    changed: bool  # a different build becomes current in this run


class Steps:
    """The steps decided so far in this run, in the order plan and apply evaluate them (every
    host's slot N before any host's slot N+1). What a step did is read from here: a later step
    never looks at a flag an earlier one set."""

    def __init__(self):
        self._by_host: dict[str, dict[str, Step]] = {}

    def add(self, host: str, slot: str, step: Step) -> None:
        self._by_host.setdefault(host, {})[slot] = step

    def on(self, host: str) -> dict[str, Step]:
        return dict(self._by_host.get(host, {}))

    def build(self, host: str) -> BuildOutcome | None:
        """The build the host's services run, as decided by its llama_cpp.build step."""
        outcome = None
        for step in self._by_host.get(host, {}).values():
            if step.build is not None:
                outcome = step.build
        return outcome

    def restarted(self) -> set[str]:
        """"host:port" of every rpc-server whose step (re)starts it."""
        return {e for steps in self._by_host.values() for s in steps.values() for e in s.restarts}

    def ran(self, host: str, resource: str) -> bool:
        """Whether a step of `resource` ("llama_cpp.build") runs commands on the host."""
        return any(slot.split("[")[0] == resource and step.commands
                   for slot, step in self._by_host.get(host, {}).items())


@dataclass
class HostContext:
    cluster: Cluster
    host: Host
    facts: dict[str, object]
    resolved: Resolved
    # What earlier steps of this run decide; the plan fills it with what they *would* do, so
    # downstream resources show known-after-apply.
    steps: Steps = field(default_factory=Steps)
    first: bool = False  # the host that resolves cluster-wide values (the first of the run)
    # apply only: runs a command on this host as the login user -> (ok, stdout lines)
    run_command: Callable[[str], tuple[bool, list[str]]] | None = None
    # Every host's facts (host name -> facts), for cluster-wide resources; apply keeps them
    # current through the resources' declared rereads.
    cluster_facts: dict[str, dict] | None = None
    # apply only: hosts whose steps failed earlier in this run (unreachable, a command failed)
    failed_hosts: frozenset[str] = frozenset()

    @property
    def prefix(self) -> str:
        return self.host.layout.prefix

    @property
    def build(self) -> BuildOutcome | None:
        return self.steps.build(self.host.name)

    def fact(self, key: str):
        return self.facts.get(key)

    def section(self, role: str) -> Any:
        """The role's own section of the cluster file (its schema.json), as plain data with
        defaults filled; the role makes its typed settings from it."""
        return self.cluster.sections[role]

    def fact_of(self, host_name: str, key: str):
        """A fact of another host (cluster-wide resources only; None when not gathered)."""
        if host_name == self.host.name:
            return self.fact(key)
        return (self.cluster_facts or {}).get(host_name, {}).get(key)

    def replacing(self, qualified: str, host_name: str | None = None) -> bool:
        """Whether `-replace` names the resource ("network.wireguard") on this host (or on
        host_name)."""
        host_name = host_name or self.host.name
        return any(a in (qualified, f"{host_name}/{qualified}") for a in self.resolved.replace)

    def servers(self):
        """llama-server instances this host runs."""
        return [s for s in self.cluster.servers if s.host == self.host.name]

    def change(self, role: str, resource: str, action: str, reason: str = "",
               diffs: list[AttrDiff] | None = None, unit_diff: str | None = None) -> Change:
        return Change(host=self.host.name, role=role, resource=resource, action=action,
                      diffs=diffs or [], reason=reason, unit_diff=unit_diff)


class SecretStdin(str):
    """A command (the string itself) whose standard input carries a secret, such as a token.

    The secret reaches the program over the SSH channel only: it is in no process's arguments,
    no file on the host (no temporary upload with a guessable name to leave behind) and no
    rendering of the command, which is all that str() and repr() show.
    """

    stdin: str

    def __new__(cls, command: str, stdin: str):
        self = super().__new__(cls, command)
        self.stdin = stdin
        return self


@dataclass
class Step:
    """One resource on one host: what the plan shows and what apply runs.

    commands run in order in one shell each (a SecretStdin also feeds its secret to the shell's
    standard input), as root when the host uses sudo; readiness checks are commands too (TCP
    probes, /health waits).
    """

    change: Change
    commands: list[str] = field(default_factory=list)
    sudo: bool = True  # False for tools that refuse root (Homebrew)
    build: BuildOutcome | None = None  # llama_cpp.build's decision (Steps.build)
    restarts: tuple[str, ...] = ()  # "host:port" of rpc-servers this step (re)starts
    # The step's role's values fixed again for later steps (Resolved.fixed: the role's own type).
    resolves: Any = None
    transfer: Transfer | None = None  # model bytes this step moves to its host

    @property
    def noop(self) -> bool:
        return self.change.action == "no-op" and not self.commands


@dataclass(frozen=True)
class Transfer:
    """Model bytes a step brings to its host: from the internet (the model's source), over the
    LAN (another host's copy), and the disk they take there (free: under the folder they go
    to; None when unknown). The plan sums them per host (Plan.transfers)."""

    internet_bytes: int = 0
    lan_bytes: int = 0
    disk_bytes: int = 0
    disk_free: int | None = None

@dataclass(frozen=True)
class Teardown:
    """A role's answer to "take what you put on this host away" (Role.destroy).

    steps: Steps whose Change has action "delete" (or no-op), one per thing removed; kept: what
    stays because only `--purge` removes it (builds, models, caches: their bytes are expensive
    to fetch or build again), as the plan says it ("model gemma (253.1 MB)").
    """

    steps: tuple = ()
    kept: tuple[str, ...] = ()


def stored_teardown(ctx: HostContext, role: str, resource: str, stored: dict, what: str,
                    purge: bool, after: tuple[str, ...] = ()):
    """The Teardown of paths a role stored (a Stored fact: path -> bytes) that only `--purge`
    removes: one delete step when purging, else a line the plan shows under what is kept.
    `after` are commands that follow the removal (rmdir of a parent once empty)."""

    if not stored:
        return Teardown()
    total = sum(stored.values())
    if not purge:
        return Teardown(kept=(f"{what} ({size_text(total)})",))
    paths = sorted(stored)
    return Teardown(steps=(Step(ctx.change(role, resource, "delete",
                                           f"--purge: {what} ({size_text(total)})",
                                           [AttrDiff("path", p, None) for p in paths]),
                                [shell.command("rm", "-rf", "--", *paths), *after]),))
