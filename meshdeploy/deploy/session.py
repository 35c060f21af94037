"""The SSH session of a command: pyinfra state, inventory and connections, and the adjustments
meshdeploy makes to pyinfra, paramiko and gevent. Entered by the commands that reach hosts
(plan, apply, status), never at import time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from meshdeploy.deploy.errors import ConnectError
from meshdeploy.deploy.model import Cluster


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

        adjust_libraries()
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
