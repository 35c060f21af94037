"""The SSH session of a command: pyinfra state, inventory and connections, and the adjustments
meshdeploy makes to pyinfra, paramiko and gevent. Entered by the commands that reach hosts
(plan, apply, status), never at import time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from meshdeploy.deploy import ssh_settings
from meshdeploy.deploy.errors import ConnectError
from meshdeploy.deploy.host_keys import host_key_error
from meshdeploy.deploy.model import Cluster
from meshdeploy.deploy.ssh_settings import SshSettings


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
    # (host name, marked output line) of apply's live progress (deploy/progress.py), or None.
    listener: object = None

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
        self.settings = {h.name: ssh_settings.resolve(h, accept_new=self.accept_new_host_keys)
                         for h in self.reached()}
        inventory = Inventory(([(name, s.pyinfra_data()) for name, s in self.settings.items()],
                               {}))
        self.state = State(inventory, Config(), check_for_changes=False)
        self.pyhosts = {h.name: h for h in inventory}
        self._count_commands()

    def warnings(self) -> list[str]:
        """What the plan must say about how the hosts were reached."""
        return ssh_settings.no_check_warnings(list(self.settings.values()))

    def read_remote(self, name: str, path: str, reader):
        """reader(file, "host:path") on `path` of host `name`, over SFTP on the open connection
        (binary-safe, and no second SSH handshake). OSError and connection failures become
        ValueError naming host and path (readers raise ValueError subclasses)."""
        where = f"{name}:{path}"
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

    def connect(self) -> None:
        import gevent
        from pyinfra.api.state import StateStage

        self.state.set_stage(StateStage.Connect)
        errors: dict[str, str] = {}
        offered: dict[str, object] = {}

        def one(name, host):
            try:
                host.connect(reason="meshdeploy", raise_exceptions=True)
            except Exception as exc:  # paramiko/socket errors come in many classes
                errors[name] = str(exc).strip().splitlines()[0] if str(exc).strip() else \
                    exc.__class__.__name__
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
            lines = [f"{n}: {m}" for n, m in sorted(errors.items())]
            raise ConnectError("cannot connect over SSH to " + "; ".join(lines),
                               hint="check the host's address, ssh settings and that sshd runs "
                                    "(or leave it out with --limit)")

    def _tap(self, name: str, host) -> None:
        from meshdeploy.deploy.progress import tap

        client = getattr(host.connector, "client", None)
        if client is not None:  # an SSH host (pyinfra's @local has no paramiko client)
            tap(client, lambda line: self.listener and self.listener(name, line))

    def run(self, host_name: str, command: str, sudo: bool | None = None):
        from pyinfra.api import StringCommand

        host = self.pyhosts[host_name]
        kwargs = {}
        if sudo is not None:
            kwargs["_sudo"] = sudo
        elif self.host(host_name).ssh.sudo:
            kwargs["_sudo"] = True
        ok, output = host.run_shell_command(StringCommand(command), **kwargs)
        return ok, output

    def close(self) -> None:
        for host in self.pyhosts.values():
            try:
                host.disconnect()
            except Exception:
                pass
