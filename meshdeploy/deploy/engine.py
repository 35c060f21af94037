"""The engine: connect, probe every host once, plan every resource, and apply through pyinfra.

Plan and apply share one code path. Each resource is a function of (wish, facts, what earlier
resources did) returning a Step; the plan evaluates them all slot by slot across hosts, apply
evaluates them again at execution time, inside pyinfra operations, so a value that only exists
after an earlier step (a resolved commit, a fresh build's flags) is used as soon as it exists.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from meshdeploy import __version__
from meshdeploy.deploy import consistency
from meshdeploy.deploy import probe as probes
from meshdeploy.deploy.context import HostContext, Resolved, Step
from meshdeploy.deploy.errors import ConnectError, PlanError
from meshdeploy.deploy.model import Cluster
from meshdeploy.deploy.plan import Plan, hash_files, utc_now
from meshdeploy.roles.llama_cpp import lock as locks
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.llama_cpp.facts import RemoteRef
from meshdeploy.roles.models import hf
from meshdeploy.roles.models import operations as models
from meshdeploy.roles.rpc_cache import operations as rpc_cache
from meshdeploy.roles.rpc_cache import layout, seeding
from meshdeploy.roles.services import argv as argvs
from meshdeploy.roles.services import operations as services
from meshdeploy.roles.toolchain import operations as toolchain

log = logging.getLogger("meshdeploy")


def slots(cluster: Cluster) -> list[tuple[str, object]]:
    """Every resource kind in apply order; every host gets all of them (pyinfra issue #1370:
    operations merge across hosts by call order, so the sequence must be identical)."""
    out = [("toolchain.apt_proxy", toolchain.apt_proxy),
           ("toolchain.packages", toolchain.packages),
           ("llama_cpp.source", llama_cpp.source),
           ("llama_cpp.build", llama_cpp.build)]
    out += [(f"models.gguf[{m}]", (lambda ctx, m=m: models.gguf(ctx, m))) for m in cluster.models]
    ports = sorted({r.port for h in cluster.hosts for r in h.rpc_servers})
    out.append(("rpc_cache.seed_tool", rpc_cache.seed_tool))
    out += [(f"rpc_cache.seed[{p}]", (lambda ctx, p=p: seeding.seed(ctx, p))) for p in ports]
    out.append(("services.cleanup", services.stale_units))
    out += [(f"services.rpc_server[{p}]", (lambda ctx, p=p: services.rpc_server(ctx, p)))
            for p in ports]
    out += [(f"services.llama_server[{s.name}]", (lambda ctx, n=s.name: services.llama_server(ctx, n)))
            for s in cluster.servers]
    return out


def ssh_target(host) -> str:
    """The name when the host's ssh_config has an entry for it (aliases, ProxyCommand), else
    the address."""
    if host.ssh.config:
        try:
            text = Path(host.ssh.config).read_text()
        except OSError:
            return host.address
        for line in text.splitlines():
            words = line.split()
            if len(words) >= 2 and words[0].lower() == "host" and host.name in words[1:]:
                return host.name
    return host.address


def _tolerate_dead_proxy_commands() -> None:
    """paramiko kills a ProxyCommand's process when it closes the socket, and again from an
    atexit hook; when the proxy already exited (the host was unreachable) that raises
    ProcessLookupError and prints a traceback after our one-line error."""
    from paramiko.proxy import ProxyCommand

    if getattr(ProxyCommand.close, "_meshdeploy", False):
        return
    original = ProxyCommand.close

    def close(self):
        try:
            original(self)
        except ProcessLookupError:
            pass

    close._meshdeploy = True
    ProxyCommand.close = close


class SudoPasswordRequired(Exception):
    """sudo asked for a password; meshdeploy never prompts (it runs unattended, in CI too)."""


def _never_prompt_for_sudo() -> None:
    import pyinfra.connectors.util as connector_util

    def refuse(prompt=""):
        raise SudoPasswordRequired("a password is required")

    connector_util.getpass = refuse


@dataclass
class Session:
    cluster: Cluster
    limit: list[str] | None = None
    state: object = None
    pyhosts: dict = field(default_factory=dict)
    commands_run: dict = field(default_factory=dict)

    def hosts(self):
        return [h for h in self.cluster.hosts if not self.limit or h.name in self.limit]

    def open(self) -> None:
        from pyinfra.api import Config, Inventory, State

        # Both libraries log connection failures with tracebacks from their own threads; the
        # engine reports each failure once, as one line naming the host.
        for name in ("pyinfra", "paramiko"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        _tolerate_dead_proxy_commands()
        _never_prompt_for_sudo()
        names = []
        for h in self.hosts():
            data = {"ssh_hostname": ssh_target(h), "ssh_port": h.ssh.port,
                    "ssh_strict_host_key_checking": "accept-new", "_sudo": h.ssh.sudo}
            if h.ssh.user:
                data["ssh_user"] = h.ssh.user
            if h.ssh.key:
                data["ssh_key"] = h.ssh.key
            if h.ssh.config:
                data["ssh_config_file"] = h.ssh.config
            names.append((h.name, data))
        inventory = Inventory((names, {}))
        self.state = State(inventory, Config(), check_for_changes=False)
        self.pyhosts = {h.name: h for h in inventory}
        self._count_commands()

    def read_header(self, name: str, path: str) -> bytes:
        """The GGUF header of `path` on host `name`, over SFTP on the plan's open connection
        (binary-safe, and no second SSH handshake)."""
        from meshdeploy.roles.rpc_cache.tensors import GgufHeaderError, header_bytes

        try:
            sftp = self.pyhosts[name].connector.client.open_sftp()
        except Exception as exc:  # paramiko raises several unrelated types here
            raise GgufHeaderError(f"{name}:{path}: no SFTP session: {exc}") from None
        try:
            with sftp.open(path, "rb") as f:
                return header_bytes(f, f"{name}:{path}")
        except OSError as exc:
            raise GgufHeaderError(f"{name}:{path}: {exc.strerror or exc}") from None
        finally:
            sftp.close()

    def _count_commands(self) -> None:
        for name, host in self.pyhosts.items():
            self.commands_run[name] = 0
            original = host.run_shell_command

            def counted(*args, _name=name, _orig=original, **kwargs):
                self.commands_run[_name] += 1
                return _orig(*args, **kwargs)

            host.run_shell_command = counted

    def connect(self) -> None:
        import gevent
        from pyinfra.api.state import StateStage

        self.state.set_stage(StateStage.Connect)
        errors: dict[str, str] = {}

        def one(name, host):
            try:
                host.connect(reason="meshdeploy", raise_exceptions=True)
            except Exception as exc:  # paramiko/socket errors come in many classes
                errors[name] = str(exc).strip().splitlines()[0] if str(exc).strip() else \
                    exc.__class__.__name__

        gevent.joinall([gevent.spawn(one, n, h) for n, h in self.pyhosts.items()])
        for name, host in self.pyhosts.items():
            if name not in errors:
                self.state.activate_host(host)
        if errors:
            lines = [f"{n}: {m}" for n, m in sorted(errors.items())]
            raise ConnectError("cannot connect over SSH to " + "; ".join(lines),
                               hint="check the host's address, ssh settings and that sshd runs "
                                    "(or leave it out with --limit)")

    def run(self, host_name: str, command: str, sudo: bool | None = None):
        from pyinfra.api import StringCommand

        host = self.pyhosts[host_name]
        kwargs = {}
        if sudo is not None:
            kwargs["_sudo"] = sudo
        elif self.cluster.host(host_name).ssh.sudo:
            kwargs["_sudo"] = True
        ok, output = host.run_shell_command(StringCommand(command), **kwargs)
        return ok, output

    def close(self) -> None:
        for host in self.pyhosts.values():
            try:
                host.disconnect()
            except Exception:
                pass


def probe_sections(cluster: Cluster, host, commit: str | None, first: bool):
    """Every fact this host's plan reads; a SudoCheck first where apply will need root."""
    sudo = [probes.Section("probe.SudoCheck", probes.SudoCheck)] if host.ssh.sudo else []
    return (sudo + toolchain.sections(cluster, host)
            + llama_cpp.sections(cluster, host, commit, first)
            + models.sections(cluster, host)
            + rpc_cache.sections(cluster, host)
            + services.sections(cluster, host))


def probe_command(cluster: Cluster, host, commit: str | None, first: bool,
                  nonce: str) -> tuple[list, str]:
    """(sections, the one remote command that gathers them all as the login user)."""
    sections = probe_sections(cluster, host, commit, first)
    return sections, probes.compose(sections, nonce, sudo=host.ssh.sudo) + "true"


SUDO_REFUSED = re.compile(r"sudo: (a password is required|.*not in the sudoers|.*not allowed)")


def gather(session: Session, commit: str | None) -> dict[str, dict]:
    """One probe command per host, all hosts at once, run unprivileged (Section.privileged)."""
    import gevent

    cluster = session.cluster
    first = session.hosts()[0].name
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}

    def one(h):
        nonce = probes.new_nonce()
        sections, script = probe_command(cluster, h, commit, h.name == first, nonce)
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


def resolve_commit(cluster: Cluster, facts: dict | None,
                   first: str | None) -> tuple[str | None, str | None, str]:
    """(commit to build, where upstream points now, how it was decided).

    The repository URL is the hosts' view of it (a mirror on their network may be unreachable
    from here), so refs are resolved on the first host, never from the control machine.
    """
    ref = cluster.llama_cpp.ref
    upstream = None
    if facts and first and facts.get(first):
        upstream = facts[first].get("llama_cpp.RemoteRef")
        if upstream == RemoteRef.MISSING:
            raise PlanError(f"llama_cpp.ref {ref!r} does not exist in {cluster.llama_cpp.repo} "
                            f"(ls-remote on {first})",
                            hint="use a tag, branch or full commit of that repository")
    if locks.FULL_COMMIT.fullmatch(ref):
        return ref, upstream, "pinned commit"
    locked = locks.locked_commit(cluster, locks.read_lock(cluster.path))
    if locked:
        return locked, upstream, "lock file"
    if upstream:
        return upstream, upstream, "ls-remote on " + first
    return None, None, "unresolved"


@dataclass
class Planned:
    plan: Plan
    resolved: Resolved
    facts: dict
    steps: dict  # host -> slot -> Step


def make_plan(session: Session) -> Planned:
    cluster = session.cluster
    hosts = session.hosts()
    commit, _, _ = resolve_commit(cluster, None, None)
    facts = gather(session, commit)
    commit, upstream, how = resolve_commit(cluster, facts, hosts[0].name)
    resolved = Resolved(commit=commit, build_number=locks.build_number(cluster.llama_cpp.ref),
                        upstream_commit=upstream)
    for name, model in cluster.models.items():
        if any(name in models.needed(cluster, h) for h in hosts) and \
                isinstance(model.source, models.HfSource):
            resolved.models[name] = hf.resolve(cluster, model)
    if resolved.models:
        resolved.hf_token = hf.token(cluster)
    placement_notes = seeding.prepare(cluster, hosts, facts, resolved,
                                      header_cache=control_cache("gguf-headers"),
                                      read_remote=session.read_header)
    for h in hosts:
        toolchain.preflight(HostContext(cluster, h, facts[h.name], resolved))
    drift = consistency.check(cluster, hosts, facts, commit, session.limit)
    steps = evaluate(cluster, hosts, facts, resolved)
    warnings = list(argvs.warnings_for(cluster)) + drift + placement_notes
    locked = locks.locked_commit(cluster, locks.read_lock(cluster.path))
    if locked and upstream and upstream != locked:
        warnings.append(f"llama.cpp {cluster.llama_cpp.ref} now points at {upstream[:12]} upstream; "
                        f"the lock keeps {locked[:12]}. To move, delete the llama_cpp entry of "
                        f"{locks.lock_path(cluster.path).name} and plan again.")
    changes = [steps[h.name][slot].change for slot, _ in slots(cluster) for h in hosts]
    plan = Plan(cluster_name=cluster.name, cluster_path=str(cluster.path),
                config_hash=config_hash(cluster),
                fingerprints={h: probes.fingerprint(f) for h, f in facts.items()},
                changes=changes, warnings=warnings, hosts=[h.name for h in hosts],
                created_at=utc_now(), meshdeploy_version=__version__,
                commit=commit, commit_source=how, limit=list(session.limit or []),
                placement=layout.sections(resolved.layouts),
                network=consistency.network(cluster, hosts, facts))
    return Planned(plan, resolved, facts, steps)


def control_cache(name: str) -> Path:
    """A folder of the control machine's cache (XDG_CACHE_HOME, else ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "meshdeploy" / name


def config_hash(cluster: Cluster) -> str:
    return hash_files([cluster.path, locks.lock_path(cluster.path)])


def evaluate(cluster, hosts, facts, resolved) -> dict:
    """Slot-major: every host's slot N before any host's slot N+1, as apply runs them."""
    contexts = {h.name: HostContext(cluster, h, facts[h.name], resolved) for h in hosts}
    steps: dict[str, dict[str, Step]] = {h.name: {} for h in hosts}
    for slot, fn in slots(cluster):
        for h in hosts:
            steps[h.name][slot] = fn(contexts[h.name])
    return steps
