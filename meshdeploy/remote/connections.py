"""Ad-hoc commands on the cluster's hosts over fabric: the connections of `logs` and `exec`.

pyinfra (meshdeploy.remote.session) runs plan and apply: operations, facts, one batched probe,
all in gevent greenlets. fabric is for what is not an operation: one command on many hosts with
its output streamed back as it comes (`journalctl -f`), its exit code, its timing. Both take the
same `SshSettings`, so a host is reached through the same ssh_config (ProxyCommand included),
user, key and port, and its key is checked under the same policy:

- yes: the known_hosts files are loaded and an unknown key is refused (paramiko's RejectPolicy);
- accept-new: an unknown key is recorded in the first known_hosts file, a changed one refused;
- no: any key is accepted, nothing is recorded.

fabric itself loads no known_hosts and accepts every key (AutoAddPolicy): `connection()` always
replaces that. A refused key ends the command before anything runs anywhere, with the
fingerprint and the fix (meshdeploy.remote.host_keys), as plan does.

The machine meshdeploy runs on (`connection: local`) gets a LocalConnection: the same run()
arguments and Result, through invoke's local runner (fabric is built on invoke), so logs, exec
and bench handle its output exactly as a remote host's.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fabric import Config, Connection
from invoke.runners import Local
from paramiko import MissingHostKeyPolicy, RejectPolicy, SSHConfig

from meshdeploy.core import shell
from meshdeploy.remote import reasons
from meshdeploy.remote.host_keys import host_key_error
from meshdeploy.remote.session import adjust_libraries
from meshdeploy.remote.ssh_settings import NO, YES, SshSettings, parse_config

class AcceptNew(MissingHostKeyPolicy):
    """OpenSSH's accept-new: an unknown key is appended to the first known_hosts file. A
    changed key never reaches a policy: paramiko raises BadHostKeyException first."""
    def __init__(self, path: str):
        self.path = path

    def missing_host_key(self, client, hostname, key):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class AcceptAny(MissingHostKeyPolicy):
    """host_key: no. Any key, nothing recorded (plan warns about such hosts)."""
    def missing_host_key(self, client, hostname, key):
        pass


class TimedConnection(Connection):
    """A fabric Connection that remembers how long its last command ran (exec's table)."""
    seconds = 0.0
    settings: SshSettings

    def run(self, command, **kwargs):
        return self._timed(super().run, command, **kwargs)

    def _timed(self, call, command, **kwargs):
        started = time.monotonic()
        try:
            return call(command, **kwargs)
        finally:
            self.seconds = time.monotonic() - started

    def dial(self, address: str, port: int, timeout: float):
        """A socket to address:port as the host itself sees it (an SSH direct-tcpip channel:
        a server listening on the host's loopback only is reached too)."""
        return self.transport.open_channel("direct-tcpip", (address, port), ("127.0.0.1", 0),
                                           timeout=timeout)


class OwnSession(Local):
    """invoke's local runner, with each command in a session (process group) of its own, as
    under sshd. A host script may end its own processes (`logs -f` does `kill 0` when its stdin
    closes); in meshdeploy's process group that would end meshdeploy and the shell around it."""
    def start(self, command: str, shell: str, env: dict) -> None:
        if self.using_pty:
            return super().start(command, shell, env)
        self.process = subprocess.Popen(command, shell=True, executable=shell, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        stdin=subprocess.PIPE, start_new_session=True)
        self.context.processes.append(self.process)

    # Under gevent's patched subprocess (plan, apply and bench: common.patch_for_gevent) the
    # pipes are non-blocking, and invoke's os.read gets EAGAIN: wait until there is data
    # (select cooperates with gevent there; unpatched, the pipes block and it never runs).
    def read_proc_stdout(self, num_bytes: int) -> bytes | None:
        if self.using_pty:
            return super().read_proc_stdout(num_bytes)
        return _read_when_ready(self.process.stdout.fileno(), num_bytes)

    def read_proc_stderr(self, num_bytes: int) -> bytes | None:
        if self.using_pty:
            return super().read_proc_stderr(num_bytes)
        return _read_when_ready(self.process.stderr.fileno(), num_bytes)


def _read_when_ready(fd: int, num_bytes: int) -> bytes:
    while True:
        try:
            return os.read(fd, num_bytes)
        except BlockingIOError:
            select.select([fd], [], [])


class LocalConnection(TimedConnection):
    """The machine meshdeploy runs on: commands run here as subprocesses of /bin/sh (the shell
    every POSIX system has); nothing to open, no host key. close() closes the standard input
    of the commands still running, as a closed SSH channel does on a remote host."""
    # Declared on the class: fabric's Connection stores an attribute it does not have in its
    # config instead. Set per instance in __init__.
    processes: list = []

    def __init__(self, settings: SshSettings):
        super().__init__("localhost", config=Config(
            ssh_config=SSHConfig(),
            overrides={"runners": {"local": OwnSession}, "run": {"shell": "/bin/sh"}}))
        self.processes = []
        self.settings = settings

    def open(self) -> None:
        pass

    @property
    def is_connected(self) -> bool:
        return True

    def run(self, command, **kwargs):
        return self._timed(self.local, command, **kwargs)

    def dial(self, address: str, port: int, timeout: float):
        return socket.create_connection((address, port), timeout=timeout)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None and process.stdin and not process.stdin.closed:
                try:
                    process.stdin.close()
                except OSError:  # the pipe broke as the command ended
                    pass


def connection(settings: SshSettings) -> TimedConnection:
    """A fabric Connection to one host, from the same settings pyinfra gets; not yet open."""
    if settings.local:
        return LocalConnection(settings)
    parsed = parse_config(settings.config)
    # An explicit SSHConfig object stops fabric from reading /etc/ssh/ssh_config and
    # ~/.ssh/config on its own: the host's ssh.config (else ~/.ssh/config) only, as pyinfra.
    config = Config(ssh_config=parsed if parsed is not None else SSHConfig())
    # The one connect timeout (ssh_settings: --connect-timeout, ConnectTimeout, 10 s), as
    # pyinfra gets it: the TCP connect and the SSH banner.
    kwargs = settings.paramiko_timeouts()
    conn = TimedConnection(
        settings.target, user=settings.user, port=settings.port, config=config,
        connect_timeout=kwargs.pop("timeout"),
        connect_kwargs={**kwargs, **({"key_filename": [settings.key]} if settings.key else {})})
    conn.settings = settings
    if settings.host_key == NO:
        conn.client.set_missing_host_key_policy(AcceptAny())
        return conn
    for path in settings.known_hosts:
        try:
            conn.client.load_system_host_keys(path)
        except (OSError, ValueError, IndexError):
            pass  # missing or unreadable: no key known from it, as OpenSSH
    conn.client.set_missing_host_key_policy(
        RejectPolicy() if settings.host_key == YES else AcceptNew(settings.known_hosts[0]))
    return conn


def _offered_key(conn, exc):
    """The key the server presented before the connection was refused, or None."""
    key = getattr(exc, "key", None)  # BadHostKeyException: a changed key
    if key is not None:
        return key
    try:
        return conn.client.get_transport().get_remote_server_key()
    except Exception:  # no transport, or no key exchange happened
        return None


def reason(exc: BaseException, conn=None) -> str:
    """Why a host could not be reached or a command on it failed (remote.reasons), with what
    the ProxyCommand of `conn` printed."""
    if conn is None or isinstance(conn, LocalConnection):
        return reasons.reason(exc)
    return reasons.of_client(exc, conn.client)


@dataclass
class Hosts:
    """The open connections of one command, in cluster file order, and the hosts that could
    not be reached ({name: reason})."""
    connections: dict
    unreachable: dict

    def close(self) -> None:
        for conn in self.connections.values():
            try:
                conn.close()
            except Exception:  # closing a connection whose proxy already died
                pass


def connect(settings: list[SshSettings]) -> Hosts:
    """Open a connection to every host at once. A refused host key raises HostKeyError before
    anything runs on any host; other failures are returned as unreachable hosts."""
    adjust_libraries()
    conns = {s.host: connection(s) for s in settings}
    failures: dict[str, tuple] = {}

    def one(name):
        try:
            conns[name].open()
        except Exception as exc:  # paramiko, socket and proxy errors come in many classes
            failures[name] = (conns[name].settings, _offered_key(conns[name], exc),
                              reason(exc, conns[name]))

    with ThreadPoolExecutor(max_workers=max(1, len(conns))) as pool:
        list(pool.map(one, conns))
    hosts = Hosts({n: c for n, c in conns.items() if n not in failures},
                  {n: f[2] for n, f in failures.items()})
    refused = host_key_error(failures) if failures else None
    if refused is not None:
        hosts.close()
        raise refused
    return hosts


def each(hosts: Hosts, work) -> dict:
    """work(name, connection) on every open connection at once: {name: result or exception}."""
    out: dict = {}

    def one(name):
        try:
            out[name] = work(name, hosts.connections[name])
        except Exception as exc:  # reported per host by the caller
            out[name] = exc

    with ThreadPoolExecutor(max_workers=max(1, len(hosts.connections))) as pool:
        list(pool.map(one, hosts.connections))
    return out


def as_root(script_text: str, sudo: bool) -> str:
    """A fixed script run by sh, under `sudo -n` (never a password prompt) when asked."""
    return shell.sudo(script_text) if sudo else shell.command("sh", "-c", script_text)
