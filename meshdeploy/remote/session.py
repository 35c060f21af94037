"""The SSH session of a command: pyinfra state, inventory and connections, and the adjustments
meshdeploy makes to pyinfra, paramiko and gevent. Entered by the commands that reach hosts
(plan, apply, status), never at import time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from meshdeploy.config.model import Cluster
from meshdeploy.core import account, shell
from meshdeploy.core.progress import tap
from meshdeploy.errors import ConnectError, PlanError
from meshdeploy.remote import reasons, ssh_settings
from meshdeploy.remote.host_keys import host_key_error
from meshdeploy.remote.ssh_settings import SshSettings


class RemoteReadError(ValueError):
    """A file on a host could not be read over SFTP."""


def adjust_libraries() -> None:
    """What meshdeploy changes in pyinfra and paramiko, in one place, when a session opens.

    Both libraries log connection failures with tracebacks from their own threads; the engine
    reports each failure once, as one line naming the host. sudo never prompts. A dead
    ProxyCommand does not print a traceback at exit.
    """
    for name in ("pyinfra", "paramiko"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    _tolerate_dead_proxy_commands()
    _proxy_commands_outlive_ctrl_c()
    _never_prompt_for_sudo()


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


def _proxy_commands_outlive_ctrl_c() -> None:
    """Two changes to paramiko's ProxyCommand (ProxyJump, `ip netns exec ... nc`):

    - a terminal's Ctrl-C goes to every process of the foreground group: the proxy would die
      with it and cut each connection mid-step, so apply could neither let the steps in flight
      finish nor stop them on the hosts. Here it starts in a session of its own (otherwise as
      paramiko's __init__ does); it still ends with the connection (paramiko's close kills it);
    - when the proxy exits (the host went down), paramiko's recv loops on its empty reads for
      ever: the connection never counts as closed, and the next command on it (releasing the
      host's lock) waits for good. Here an empty read returns what was read, and an empty
      answer is the end of the connection, as a socket's is.
    """
    import os
    import select
    import socket
    import subprocess
    import time

    from paramiko.proxy import ProxyCommand, ProxyCommandFailure

    if getattr(ProxyCommand.__init__, "_meshdeploy", False):
        return

    def __init__(self, command_line):
        self.cmd = shell.split(command_line)
        self.process = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, bufsize=0,
                                        start_new_session=True)
        self.timeout = None

    def recv(self, size):
        buffer = b""
        start = time.time()
        try:
            while len(buffer) < size:
                wait = None
                if self.timeout is not None:
                    wait = self.timeout - (time.time() - start)
                    if wait <= 0:
                        raise socket.timeout()
                ready, _, _ = select.select([self.process.stdout], [], [], wait)
                if ready:
                    chunk = os.read(self.process.stdout.fileno(), size - len(buffer))
                    if not chunk:
                        return buffer  # the proxy exited
                    buffer += chunk
            return buffer
        except socket.timeout:
            if buffer:
                return buffer
            raise
        except OSError as exc:
            raise ProxyCommandFailure(" ".join(self.cmd), exc.strerror) from None

    __init__._meshdeploy = True
    ProxyCommand.__init__ = __init__
    ProxyCommand.recv = recv


def _offered_key(host):
    """The host key the server presented before the connection failed, or None.

    pyinfra turns paramiko's BadHostKeyException and its StrictPolicy's SSHException into a
    message without the key; the failed client still holds the transport that received it.
    """
    try:
        return host.connector.client.get_transport().get_remote_server_key()
    except Exception:  # no client, no transport, or no key exchange happened
        return None


class SudoPasswordRequired(Exception):
    """sudo asked for a password; meshdeploy never prompts (it runs unattended, in CI too)."""


def _never_prompt_for_sudo() -> None:
    import pyinfra.connectors.util as connector_util

    def refuse(prompt=""):
        raise SudoPasswordRequired("a password is required")

    connector_util.getpass = refuse


def use_local_connectors(inventory, names: list[str]) -> None:
    """The hosts `names` of `inventory` run through pyinfra's @local connector.

    pyinfra gives @local only to a host named `@local`, and names it so in its output and in
    every operation's `host.name`; a local host keeps its cluster file name (the plan's
    addresses, apply's steps and pyinfra's output say `node1`) and only its connector class is
    swapped, before State creates the connectors.
    """
    from pyinfra.api.connectors import get_execution_connector

    for name in names:
        inventory.get_host(name).connector_cls = get_execution_connector("local")


def away_warning(cluster, name: str, why: str) -> str:
    """What a plan says about host `name`, which could not be reached: left out as --limit
    would leave it, and what that means for each server it serves or runs."""
    parts = []
    for server in cluster.servers:
        workers = sorted({e.host.name for e in cluster.rpc_endpoints(server)})
        if server.host == name:
            parts.append(f"llama-server {server.name} runs there and is not planned")
        elif name in workers:
            parts.append(f"llama-server {server.name} on {server.host} uses its rpc-server: "
                         f"while {name} is away {server.name} serves only on a placement "
                         f"without {name}, if it has one, else it is down")
    meaning = "; ".join(parts) or "no server uses it"
    return (f"{name} could not be reached ({why}): this plan leaves it out, as --limit would, "
            f"and changes nothing there; {meaning}")


@dataclass
class Session:
    cluster: Cluster
    limit: list[str] | None = None
    state: object = None
    pyhosts: dict = field(default_factory=dict)
    commands_run: dict = field(default_factory=dict)
    accept_new_host_keys: bool = False  # --accept-new-host-keys
    settings: dict[str, SshSettings] = field(default_factory=dict)
    # Hosts to reach that the file no longer has (from the state file): they are destroyed.
    departed: list = field(default_factory=list)
    # (host name, marked output line) of apply's live progress (core/progress.py), or None.
    listener: object = None
    # {host: why} of the hosts connect(tolerate=True) could not reach (remote.reasons' words).
    unreachable: dict[str, str] = field(default_factory=dict)

    def hosts(self):
        """The file's hosts this run covers."""
        return [h for h in self.cluster.hosts if not self.limit or h.name in self.limit]

    def reached(self):
        """Every host the session connects to: the file's, then the departed."""
        return self.hosts() + list(self.departed)

    def host(self, name: str):
        return next(h for h in self.reached() if h.name == name)

    def open(self) -> None:
        from pyinfra.api import Config, Inventory, State

        adjust_libraries()
        self._one_local_host()
        self.settings = {h.name: ssh_settings.resolve(h, accept_new=self.accept_new_host_keys)
                         for h in self.reached()}
        inventory = Inventory(([(name, s.pyinfra_data()) for name, s in self.settings.items()],
                               {}))
        use_local_connectors(inventory, [n for n, s in self.settings.items() if s.local])
        self.state = State(inventory, Config(), check_for_changes=False)
        self.pyhosts = {h.name: h for h in inventory}
        self._count_commands()

    def _one_local_host(self) -> None:
        """A departed local host is this machine, as the file's local host is: destroying it
        would remove what the other one runs here (the same unit names)."""
        local = [h for h in self.reached() if h.local]
        if len(local) > 1:
            gone = [h.name for h in local if h in self.departed]
            raise PlanError(f"{' and '.join(h.name for h in local)} are all this machine "
                            f"(connection: local), and {', '.join(gone)} left the cluster "
                            "file: destroying it would remove what the other runs here",
                            hint="leave the departed host out with --limit, or move the state "
                                 "file away and run `meshdeploy state rebuild FILE`")

    def warnings(self) -> list[str]:
        """What the plan must say about how the hosts were reached: host keys not checked, and
        each host connect(tolerate=True) could not reach, with what it means for the servers."""
        return (ssh_settings.no_check_warnings(list(self.settings.values()))
                + [away_warning(self.cluster, name, why)
                   for name, why in sorted(self.unreachable.items())])

    def leave_out_unreachable(self) -> None:
        """Narrow the run to the hosts connect(tolerate=True) reached, as --limit would: the
        others are neither probed nor changed (plan with a host away)."""
        if not self.unreachable:
            return
        left = [h.name for h in self.hosts() if h.name not in self.unreachable]
        if not left:  # nothing to plan: one error, as without tolerate
            raise ConnectError("cannot connect over SSH to " + "; ".join(
                f"{n}: {m}" for n, m in sorted(self.unreachable.items())),
                hint="check the hosts' addresses, ssh settings and that sshd runs")
        self.limit = left
        self.departed = [h for h in self.departed if h.name not in self.unreachable]

    def read_remote(self, name: str, path: str, reader):
        """reader(file, "host:path") on `path` of host `name`, over SFTP on the open connection
        (binary-safe, and no second SSH handshake). OSError and connection failures become
        ValueError naming host and path (readers raise ValueError subclasses)."""
        where = f"{name}:{path}"
        if self.settings[name].local:
            try:
                with open(path, "rb") as f:
                    return reader(f, where)
            except OSError as exc:
                raise RemoteReadError(f"{where}: {exc.strerror or exc}") from None
        try:
            sftp = self.pyhosts[name].connector.client.open_sftp()
        except Exception as exc:  # paramiko raises several unrelated types here
            raise RemoteReadError(f"{where}: no SFTP session: {exc}") from None
        try:
            with sftp.open(path, "rb") as f:
                return reader(f, where)
        except OSError as exc:
            raise RemoteReadError(f"{where}: {exc.strerror or exc}") from None
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

    def connect(self, tolerate: bool = False) -> None:
        """Connect to every host at once. A refused host key always raises (HostKeyError,
        before anything runs anywhere); another failure raises ConnectError naming each host
        and why, unless `tolerate`: then the host is left out and named in `unreachable`
        (status reports the others)."""
        import gevent
        from pyinfra.api.state import StateStage

        self.state.set_stage(StateStage.Connect)
        errors: dict[str, str] = {}
        offered: dict[str, object] = {}

        def one(name, host):
            try:
                host.connect(reason="meshdeploy", raise_exceptions=True)
            except Exception as exc:  # paramiko/socket errors come in many classes
                errors[name] = reasons.of_client(exc, getattr(host.connector, "client", None))
                offered[name] = _offered_key(host)

        gevent.joinall([gevent.spawn(one, n, h) for n, h in self.pyhosts.items()])
        for name, host in self.pyhosts.items():
            if name not in errors:
                self.state.activate_host(host)
                self._tap(name, host)
        if errors:
            refused = host_key_error({n: (self.settings[n], offered[n], m)
                                      for n, m in errors.items()})
            if refused is not None:
                raise refused
            if not tolerate:
                lines = [f"{n}: {m}" for n, m in sorted(errors.items())]
                raise ConnectError("cannot connect over SSH to " + "; ".join(lines),
                                   hint="check the host's address, ssh settings and that sshd "
                                        "runs (or leave it out with --limit)")
            self.unreachable.update(errors)
        self._read_accounts(tolerate)

    def _read_accounts(self, tolerate: bool = False) -> None:
        """Each rootless host's folders and service manager (core.account), read once as its
        login user; the session's cluster (and departed hosts) then carry them, so every role
        plans with the host's own paths. A host without a usable service manager is refused
        here, before anything is probed or changed (with `tolerate`, it joins `unreachable`)."""
        import gevent

        rootless = [h for h in self.reached() if h.rootless and h.layout is None
                    and h.name not in self.unreachable]
        if not rootless:
            return
        found: dict = {}
        errors: list[PlanError] = []

        def one(h):
            try:
                ok, output = self.run(h.name, account.SCRIPT, sudo=False)
            except Exception as exc:  # a dropped connection surfaces as paramiko/socket errors
                failed(h.name, PlanError(f"host {h.name}: cannot read the login user's folders: "
                                         f"{reasons.reason(exc)}"))
                return
            try:
                found[h.name] = account.layout(account.parse(h.name, output.stdout_lines))
            except PlanError as exc:
                failed(h.name, exc)

        def failed(name: str, exc: PlanError) -> None:
            if tolerate:
                self.unreachable[name] = exc.message
            else:
                errors.append(exc)

        gevent.joinall([gevent.spawn(one, h) for h in rootless])
        if errors:
            errors.sort(key=lambda e: e.message)
            raise PlanError("; ".join(e.message for e in errors),
                            hint="; ".join(e.hint for e in errors if e.hint) or None)
        self.cluster = account.resolved(self.cluster, found)
        self.departed = [account.resolved_host(h, found[h.name]) if h.name in found else h
                         for h in self.departed]

    def _tap(self, name: str, host) -> None:

        client = getattr(host.connector, "client", None)
        if client is not None:  # an SSH host (pyinfra's @local has no paramiko client)
            tap(client, lambda line: self.listener and self.listener(name, line))

    def run(self, host_name: str, command: str, sudo: bool | None = None):
        from pyinfra.api import StringCommand

        host = self.pyhosts[host_name]
        kwargs = {}
        if sudo is not None:
            kwargs["_sudo"] = sudo
        elif self.host(host_name).sudo:
            kwargs["_sudo"] = True
        ok, output = host.run_shell_command(StringCommand(command), **kwargs)
        return ok, output

    def connection_lost(self, name: str) -> bool:
        """Whether the SSH connection to host `name` ended (the host went down or away)."""
        try:
            transport = self.pyhosts[name].connector.client.get_transport()
        except Exception:  # no connector or client: never connected, or torn down
            return True
        return transport is None or not transport.is_active()

    def close(self) -> None:
        for host in self.pyhosts.values():
            try:
                host.disconnect()
            except Exception:
                pass
