"""The engine: probe every host once, prepare cluster-wide values, and plan every resource.

Plan and apply share one code path. Each resource (core.registry) is a function of (wish,
facts, what earlier steps decide) returning a Step; the plan evaluates them all slot by slot
across hosts, apply evaluates them again at execution time, inside pyinfra operations, so a value
that only exists after an earlier step (a resolved commit, a fresh build's flags) is used as soon
as it exists.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from meshdeploy import __version__
from meshdeploy.config.model import Cluster
from meshdeploy.core import probe as probes
from meshdeploy.core import registry
from meshdeploy.core.context import HostContext, Resolved, Steps
from meshdeploy.core.plan import HostAccess, Plan, TransferRow, hash_files, utc_now
from meshdeploy.engine import speeds as speed_store
from meshdeploy.engine import targets as targeting
from meshdeploy.errors import ConnectError, PlanError
from meshdeploy.remote.session import Session, SudoPasswordRequired

log = logging.getLogger("meshdeploy")


def probe_sections(cluster: Cluster, host, first: bool, destroying: bool = False):
    """Every fact this host's plan reads; where apply will need root, a SudoCheck first and the
    privileged sections right after it: one sudo answers them all (probes.compose)."""
    sections = registry.sections(registry.FactRequest(cluster, host, first, destroying))
    if not host.sudo:
        return sections
    return ([probes.Section("probe.SudoCheck", probes.SudoCheck)]
            + [s for s in sections if s.privileged] + [s for s in sections if not s.privileged])


def probe_command(cluster: Cluster, host, first: bool, nonce: str,
                  destroying: bool = False) -> tuple[list, str]:
    """(sections, the one remote command that gathers them all as the login user)."""
    sections = probe_sections(cluster, host, first, destroying)
    return sections, probes.compose(sections, nonce, sudo=host.sudo) + "true"


LAYOUT_FACT = "account.Layout"  # a rootless host's folders and manager, as the session read them
SUDO_REFUSED = re.compile(r"sudo: (a password is required|.*not in the sudoers|.*not allowed)")


def gather(session: Session, hosts=None, destroying=frozenset()) -> dict[str, dict]:
    """One probe command per host, all hosts at once, run unprivileged (Section.privileged).
    Hosts named in `destroying` also gather what their roles' destroy hooks read."""
    import gevent

    cluster = session.cluster
    hosts = session.hosts() if hosts is None else hosts
    first = registry.resolver(session.hosts())
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}

    def one(h):
        nonce = probes.new_nonce()
        leaving = h.name in destroying
        sections, script = probe_command(cluster, h, h.name == first and not leaving, nonce,
                                         leaving)
        user = _user(h)
        try:
            ok, output = session.run(h.name, script, sudo=False)
        except SudoPasswordRequired as exc:
            errors[h.name] = f"sudo refused for user {user}: {exc}"
            return
        except Exception as exc:  # a dropped connection surfaces as paramiko/socket errors
            errors[h.name] = f"{exc.__class__.__name__}: {exc}"
            return
        if not ok:
            text = "\n".join(output.stderr_lines[-5:]) if hasattr(output, "stderr_lines") else ""
            if SUDO_REFUSED.search(text):
                errors[h.name] = (f"sudo refused for user {user}: "
                                  f"{text.strip().splitlines()[-1]}")
            else:
                errors[h.name] = text.strip() or "the probe failed"
            return
        facts = probes.decode(sections, probes.split(output.stdout_lines, sections, nonce))
        check = facts.pop("probe.SudoCheck", None)
        if check is not None and not check["ok"]:
            errors[h.name] = f"sudo refused for user {user}: {check['message']}"
            return
        if h.rootless and h.layout is not None:
            # Part of the host's fingerprint: a saved plan is refused when the folders or the
            # service manager it was made for changed before apply (core.plan.check_fresh).
            facts[LAYOUT_FACT] = asdict(h.layout)
        results[h.name] = facts

    gevent.joinall([gevent.spawn(one, h) for h in hosts])
    if errors:
        detail = "; ".join(f"{n}: {m}" for n, m in sorted(errors.items()))
        sudo = any("sudo refused" in m for m in errors.values())
        local = any(h.local for h in hosts if h.name in errors)
        raise ConnectError(f"cannot read facts: {detail}",
                           hint="give the user passwordless sudo, or set ssh.sudo false for a "
                                "user that owns llama_cpp.prefix" +
                                ("; on the local host, or run meshdeploy as root" if local
                                 else "") if sudo else
                           "run the failing command by hand on the host to see why")
    return results


def _user(host) -> str:
    """Who runs the host's commands, for messages: the login user, or this process's user."""
    if host.local:
        import getpass

        return f"{getpass.getuser()} (local)"
    return host.ssh.user or "(default)"


@dataclass(frozen=True)
class Prepared:
    """Every role's cluster-wide values, its warnings and the plan sections it fills."""

    resolved: Resolved
    warnings: list
    placement: list
    network: list
    access: list
    commit: tuple[str | None, str] = (None, "unresolved")  # Prepared.commit: the plan's header


def prepare(cluster: Cluster, hosts, facts: dict, header_cache=None, read_remote=None,
            roles=None, speeds=None, replacing=()) -> Prepared:
    """Each role's prepare hook in registry order; later roles see what earlier ones fixed.
    + speeds: measured device speeds (engine.speeds.read); None reads the cluster file's own
    + replacing: the run's -replace addresses (Resolved.replace), which the hooks see too"""
    if speeds is None:
        speeds = speed_store.read(cluster.path)
    resolved, warnings, placement, network, access = (Resolved(replace=tuple(replacing)), [],
                                                      [], [], [])
    commit: tuple[str | None, str] = (None, "unresolved")
    for role in roles if roles is not None else registry.roles():
        if role.prepare is None:
            continue
        out = role.prepare(registry.Prepare(cluster, hosts, facts, resolved, header_cache,
                                            read_remote, speeds))
        if out.values is not None:
            resolved = resolved.fixed(role.name, out.values)
        commit = out.commit or commit
        warnings += out.warnings
        placement += out.placement
        network += out.network
        access += out.access
    return Prepared(resolved, warnings, placement, network, access, commit)


@dataclass
class Planned:
    plan: Plan
    resolved: Resolved
    facts: dict
    steps: Steps
    # Destroy steps by (host, role), run after every resource, roles in reverse order.
    teardown: dict = field(default_factory=dict)
    leaving: tuple[str, ...] = ()  # hosts whose resources all answer "leaves the cluster"
    destroyed: set = field(default_factory=set)  # apply: (host, role) whose destroy ran
    # -target: the (host, slot) pairs planned and applied (engine.targets); None: all of them.
    targeted: frozenset | None = None

    def destroyed_hosts(self, candidates) -> set[str]:
        """Those of `candidates` (host names) every planned destroy step of which ran (none
        under -target, which plans no destroy)."""
        if self.targeted is not None:
            return set()
        return {h for h in candidates if all((h, r) in self.destroyed
                                             for hh, r in self.teardown if hh == h)}


def check_replace(cluster: Cluster, addresses) -> tuple[str, ...]:
    """`-replace=ADDRESS` values ("network.wireguard", "node2/network.wireguard"), each naming a
    registered resource that can be replaced and, when given, a host of the file."""
    hosts = {h.name for h in cluster.hosts}
    for address in addresses:
        host, _, qualified = address.rpartition("/")
        try:
            resource = registry.resource(qualified)
        except KeyError:
            resource = None
        if resource is None or (host and host not in hosts):
            raise PlanError(f"-replace={address}: no such resource address",
                            hint="write RESOURCE or HOST/RESOURCE as a plan prints it, e.g. "
                                 "-replace=network.wireguard or -replace=node2/network.wireguard")
        if not resource.replaceable:
            can = sorted(r.qualified for r in registry.resources() if r.replaceable)
            raise PlanError(f"-replace={address}: {qualified} cannot be replaced",
                            hint=f"resources that can: {', '.join(can) or 'none'}")
    return tuple(addresses)


def make_plan(session: Session, replacing=(), purge: bool = False, targets=()) -> Planned:
    """The plan of the file's hosts, and the destroy of the session's departed hosts; with
    -target addresses, of those resources and what they need only (engine.targets)."""
    cluster = session.cluster
    hosts = session.hosts()
    replacing = check_replace(cluster, replacing)
    targets = targeting.check(cluster, targets, hosts)
    departed = list(session.departed)
    facts = gather(session, hosts + departed, {h.name for h in departed})
    prepared = prepare(cluster, hosts, facts, header_cache=control_cache("gguf-headers"),
                       read_remote=session.read_remote, replacing=replacing)
    resolved = prepared.resolved
    first = registry.resolver(hosts)  # as evaluate() has it: the host that resolves
    for role in registry.roles():
        if role.preflight is not None:
            for h in hosts:
                role.preflight(HostContext(cluster, h, facts[h.name], resolved,
                                           first=h.name == first))
    checked = registry.checks(registry.Check(cluster, hosts, facts, resolved,
                                             tuple(session.limit or ())))
    targeted = targeting.closure(cluster, hosts, targets)
    steps = evaluate(cluster, hosts, facts, resolved, targeted)
    warnings = session.warnings() + list(prepared.warnings) + checked
    changes = [steps.on(h.name)[slot.name].change for slot in registry.slots(cluster)
               for h in hosts if slot.name in steps.on(h.name)]
    torn, kept = teardown(cluster, departed if targeted is None else [], facts, resolved, purge)
    if targeted is not None:
        every = len(registry.slots(cluster)) * len(hosts)
        warnings.append(targeting.warning(targets, len(changes), every - len(changes)))
    changes += [s.change for host_steps in torn.values() for s in host_steps]
    plan = Plan(cluster_name=cluster.name, cluster_path=str(cluster.path),
                config_hash=config_hash(cluster),
                fingerprints={h: probes.fingerprint(f, registry.volatile())
                              for h, f in facts.items()},
                changes=changes, warnings=warnings, hosts=[h.name for h in hosts],
                created_at=utc_now(), meshdeploy_version=__version__,
                commit=prepared.commit[0], commit_source=prepared.commit[1],
                limit=list(session.limit or []), placement=list(prepared.placement),
                network=list(prepared.network),
                transfers=transfer_rows([h.name for h in hosts], steps),
                access=host_access(hosts, prepared.access),
                replace=list(replacing), kept=kept, purge=purge,
                local_host=_local_host(hosts + departed), target=list(targets))
    return Planned(plan, resolved, facts, steps, torn, targeted=targeted)


def transfer_rows(hosts: list[str], steps: Steps) -> list[TransferRow]:
    """The model bytes each host receives: its steps' Transfers summed, one row per host (in
    `hosts` order) that receives any; disk_free is the least one known (None: none known)."""
    rows = []
    for host in hosts:
        moved = [s.transfer for s in steps.on(host).values() if s.transfer is not None]
        row = TransferRow(host, sum(t.internet_bytes for t in moved),
                          sum(t.lan_bytes for t in moved), sum(t.disk_bytes for t in moved),
                          min((t.disk_free for t in moved if t.disk_free is not None),
                              default=None))
        if row.internet_bytes or row.lan_bytes or row.disk_bytes:
            rows.append(row)
    return rows


def host_access(hosts, said) -> list[HostAccess]:
    """Per host, how meshdeploy works there: root or the login user (the file says), and what
    the roles said (`said`: their Prepared.access entries); only for a cluster with a rootless
    host (any other is root and the system's service manager everywhere, as plans assume)."""
    if not any(h.rootless for h in hosts):
        return []
    columns: dict = {}
    for host, column, text in said:
        columns.setdefault(host, {})[column] = text
    rows = []
    for h in hosts:
        access = f"rootless (user {h.layout.user or '?'})" if h.rootless else \
            "root (sudo)" if h.sudo else "root"
        mine = columns.get(h.name, {})
        rows.append(HostAccess(h.name, access, mine.get("manager", "?"),
                               mine.get("protection", "?")))
    return rows


def _local_host(hosts) -> str | None:
    return next((h.name for h in hosts if h.local), None)


def teardown(cluster: Cluster, hosts, facts: dict, resolved: Resolved,
             purge: bool) -> tuple[dict, list[str]]:
    """Every role's destroy hook on each host, roles in reverse registry order (services
    before the network that filters them, the build last): ({(host, role): [Step]}, kept)."""
    torn: dict[tuple[str, str], list] = {}
    kept: list[str] = []
    for h in hosts:
        mine: list[str] = []
        for role in reversed(registry.roles()):
            if role.destroy is None:
                continue
            out = role.destroy(HostContext(cluster, h, facts[h.name], resolved), purge)
            steps = [s for s in out.steps if not s.noop]
            if steps:
                torn[(h.name, role.name)] = steps
            mine += out.kept
        if mine:
            kept.append(f"{h.name}: {'; '.join(mine)}")
    return torn, kept


def make_destroy_plan(session: Session, purge: bool) -> Planned:
    """`meshdeploy destroy`: every reached host's destroy, nothing else planned."""
    cluster = session.cluster
    reached = session.reached()
    facts = gather(session, reached, {h.name for h in reached})
    torn, kept = teardown(cluster, reached, facts, Resolved(), purge)
    plan = Plan(cluster_name=cluster.name, cluster_path=str(cluster.path),
                config_hash=config_hash(cluster),
                fingerprints={h: probes.fingerprint(f, registry.volatile())
                              for h, f in facts.items()},
                changes=[s.change for steps in torn.values() for s in steps],
                warnings=session.warnings(), hosts=[h.name for h in reached],
                created_at=utc_now(), meshdeploy_version=__version__,
                limit=list(session.limit or []), kept=kept, purge=purge,
                local_host=_local_host(reached))
    return Planned(plan, Resolved(), facts, Steps(), torn,
                   leaving=tuple(h.name for h in reached))


def control_cache(name: str) -> Path:
    """A folder of the control machine's cache (XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meshdeploy" / name


def config_hash(cluster: Cluster) -> str:
    """The cluster file and every file a role plans from (the lock file)."""
    inputs = [cluster.path]
    for role in registry.roles():
        if role.inputs is not None:
            inputs += role.inputs(cluster)
    return hash_files(inputs)


def evaluate(cluster, hosts, facts, resolved, targeted=None) -> Steps:
    """Slot-major: every host's slot N before any host's slot N+1, as apply runs them; with
    `targeted` (engine.targets.closure), only its (host, slot) pairs."""
    steps = Steps()
    first = registry.resolver(hosts)
    for slot in registry.slots(cluster):
        for h in hosts:
            if targeted is not None and (h.name, slot.name) not in targeted:
                continue
            ctx = HostContext(cluster, h, facts[h.name], resolved, steps, first=h.name == first,
                              cluster_facts=facts)
            steps.add(h.name, slot.name, slot.resource.plan(ctx, slot.key))
    return steps
