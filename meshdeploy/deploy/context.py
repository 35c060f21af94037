"""What a role's planning functions see: the wish (cluster, host), the facts, and the run so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshdeploy.deploy.model import Cluster, Host
from meshdeploy.deploy.plan import AttrDiff, Change


@dataclass
class Resolved:
    """Values fixed once for the whole cluster before any host changes.

    commit is None when the ref could not be resolved yet (no host has git and the control
    machine cannot reach the repository): the plan then says "(known after apply)" and apply
    resolves it on the first host right after the toolchain is in place.
    """

    commit: str | None = None
    build_number: int | None = None
    upstream_commit: str | None = None  # what the ref points at now, when it was checked
    models: dict = field(default_factory=dict)  # model name -> roles.models.hf.HfResolved
    hf_token: str | None = field(default=None, repr=False)  # control machine's, for downloads
    # "host:port" of rpc-servers (re)started by this run: their llama-servers restart after.
    restarted: set = field(default_factory=set)
    # roles.rpc_cache.seeding.prepare: "host:port" -> SeedModel tuple, and placement layouts.
    seeds: dict = field(default_factory=dict)
    layouts: list = field(default_factory=list)


@dataclass
class HostContext:
    cluster: Cluster
    host: Host
    facts: dict[str, object]
    resolved: Resolved
    # Filled during apply by earlier steps of this host (e.g. "build_changed": True); the plan
    # fills it with what the steps *would* do, so downstream resources show known-after-apply.
    run: dict = field(default_factory=dict)

    @property
    def prefix(self) -> str:
        return self.cluster.llama_cpp.prefix

    def fact(self, key: str):
        return self.facts.get(key)

    def servers(self):
        """llama-server instances this host runs."""
        return [s for s in self.cluster.servers if s.host == self.host.name]

    def change(self, role: str, resource: str, action: str, reason: str = "",
               diffs: list[AttrDiff] | None = None, unit_diff: str | None = None) -> Change:
        return Change(host=self.host.name, role=role, resource=resource, action=action,
                      diffs=diffs or [], reason=reason, unit_diff=unit_diff)


@dataclass(frozen=True)
class Upload:
    """A file sent over SFTP rather than written by a command: what must never appear in a
    process's arguments or in logs (tokens) travels this way."""

    content: str
    path: str

    def __str__(self) -> str:
        return f"upload {self.path}"


@dataclass
class Step:
    """One resource on one host: what the plan shows and what apply runs.

    commands run in order in one shell each (an Upload item sends a file instead), as root when
    the host uses sudo; readiness checks are commands too (TCP probes, /health waits).
    """

    change: Change
    commands: list[str] = field(default_factory=list)
    deferred: bool = False  # commands are computed at apply time (depend on earlier results)
    sudo: bool = True  # False for tools that refuse root (Homebrew)

    @property
    def noop(self) -> bool:
        return self.change.action == "no-op" and not self.commands
