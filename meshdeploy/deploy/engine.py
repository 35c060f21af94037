"""The engine: probe every host once, prepare cluster-wide values, and plan every resource.

Plan and apply share one code path. Each resource (deploy.registry) is a function of (wish,
facts, what earlier steps decide) returning a Step; the plan evaluates them all slot by slot
across hosts, apply evaluates them again at execution time, inside pyinfra operations, so a value
that only exists after an earlier step (a resolved commit, a fresh build's flags) is used as soon
as it exists.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from meshdeploy import __version__
from meshdeploy.deploy import consistency, registry
from meshdeploy.deploy import probe as probes
from meshdeploy.deploy.context import HostContext, Resolved, Steps
from meshdeploy.deploy.errors import ConnectError
from meshdeploy.deploy.model import Cluster
from meshdeploy.deploy.plan import Plan, hash_files, utc_now
from meshdeploy.deploy.session import Session, SudoPasswordRequired

log = logging.getLogger("meshdeploy")


def probe_sections(cluster: Cluster, host, first: bool):
    """Every fact this host's plan reads; a SudoCheck first where apply will need root."""
    sudo = [probes.Section("probe.SudoCheck", probes.SudoCheck)] if host.ssh.sudo else []
    return sudo + registry.sections(registry.FactRequest(cluster, host, first))


def probe_command(cluster: Cluster, host, first: bool, nonce: str) -> tuple[list, str]:
    """(sections, the one remote command that gathers them all as the login user)."""
    sections = probe_sections(cluster, host, first)
    return sections, probes.compose(sections, nonce, sudo=host.ssh.sudo) + "true"


SUDO_REFUSED = re.compile(r"sudo: (a password is required|.*not in the sudoers|.*not allowed)")


def gather(session: Session) -> dict[str, dict]:
    """One probe command per host, all hosts at once, run unprivileged (Section.privileged)."""
    import gevent

    cluster = session.cluster
    first = session.hosts()[0].name
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}

    def one(h):
        nonce = probes.new_nonce()
        sections, script = probe_command(cluster, h, h.name == first, nonce)
        user = h.ssh.user or "(default)"
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
        results[h.name] = facts

    gevent.joinall([gevent.spawn(one, h) for h in session.hosts()])
    if errors:
        detail = "; ".join(f"{n}: {m}" for n, m in sorted(errors.items()))
        sudo = any("sudo refused" in m for m in errors.values())
        raise ConnectError(f"cannot read facts: {detail}",
                           hint="give the user passwordless sudo, or set ssh.sudo false for a "
                                "user that owns llama_cpp.prefix" if sudo else
                           "run the failing command by hand on the host to see why")
    return results


@dataclass(frozen=True)
class Prepared:
    """Every role's cluster-wide values, its warnings and its placement sections."""

    resolved: Resolved
    warnings: list
    placement: list


def prepare(cluster: Cluster, hosts, facts: dict, header_cache=None, read_remote=None,
            roles=None) -> Prepared:
    """Each role's prepare hook in registry order; later roles see what earlier ones fixed."""
    resolved, warnings, placement = Resolved(), [], []
    for role in roles if roles is not None else registry.roles():
        if role.prepare is None:
            continue
        out = role.prepare(registry.Prepare(cluster, hosts, facts, resolved, header_cache,
                                            read_remote))
        resolved = replace(resolved, **out.values)
        warnings += out.warnings
        placement += out.placement
    return Prepared(resolved, warnings, placement)


@dataclass
class Planned:
    plan: Plan
    resolved: Resolved
    facts: dict
    steps: Steps


def make_plan(session: Session) -> Planned:
    cluster = session.cluster
    hosts = session.hosts()
    facts = gather(session)
    prepared = prepare(cluster, hosts, facts, header_cache=control_cache("gguf-headers"),
                       read_remote=session.read_remote)
    resolved = prepared.resolved
    for role in registry.roles():
        if role.preflight is not None:
            for h in hosts:
                role.preflight(HostContext(cluster, h, facts[h.name], resolved))
    drift = consistency.check(cluster, hosts, facts, resolved.commit, session.limit)
    steps = evaluate(cluster, hosts, facts, resolved)
    warnings = list(prepared.warnings) + drift
    changes = [steps.on(h.name)[slot.name].change for slot in registry.slots(cluster)
               for h in hosts]
    plan = Plan(cluster_name=cluster.name, cluster_path=str(cluster.path),
                config_hash=config_hash(cluster),
                fingerprints={h: probes.fingerprint(f, registry.volatile())
                              for h, f in facts.items()},
                changes=changes, warnings=warnings, hosts=[h.name for h in hosts],
                created_at=utc_now(), meshdeploy_version=__version__,
                commit=resolved.commit, commit_source=resolved.commit_source,
                limit=list(session.limit or []), placement=list(prepared.placement),
                network=consistency.network(cluster, hosts, facts))
    return Planned(plan, resolved, facts, steps)


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


def evaluate(cluster, hosts, facts, resolved) -> Steps:
    """Slot-major: every host's slot N before any host's slot N+1, as apply runs them."""
    steps = Steps()
    first = hosts[0].name if hosts else None
    for slot in registry.slots(cluster):
        for h in hosts:
            ctx = HostContext(cluster, h, facts[h.name], resolved, steps, first=h.name == first)
            steps.add(h.name, slot.name, slot.resource.plan(ctx, slot.key))
    return steps
