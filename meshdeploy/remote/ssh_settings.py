"""How meshdeploy logs into one host: target, port, user, key, ssh_config and the host-key
policy, resolved once from the cluster file, the ssh_config and the command line.

pyinfra (meshdeploy.remote.session) takes `SshSettings.pyinfra_data()`; fabric (`logs`,
`exec`: meshdeploy.remote.connections.connection) takes the same object, so every connection
reaches the same address through the same ssh_config and checks host keys the same way.

The host-key policy, most specific first:
1. `--accept-new-host-keys` turns a strict host into accept-new for this run (a host set to
   `no` stays `no`);
2. `hosts.<name>.ssh.host_key` in the cluster file;
3. StrictHostKeyChecking for the host in its ssh_config (`ssh.config`, else ~/.ssh/config),
   as OpenSSH reads it; `ask` counts as `yes` (meshdeploy never prompts), `off` as `no`;
4. `yes`, what OpenSSH does by default when it cannot ask.
pyinfra's own default (accept-new, which also overrides the ssh_config) never applies: the
policy is always passed explicitly.

The connect timeout, one for both stacks and every command (OpenSSH's ConnectTimeout: the TCP
connect and the SSH banner, also through a ProxyCommand), most specific first:
1. `--connect-timeout SECONDS` (every command; the command line puts it in the environment as
   MESHDEPLOY_CONNECT_TIMEOUT, which may also be set by hand);
2. ConnectTimeout for the host in its ssh_config;
3. 10 s (pyinfra's own default; paramiko's banner wait alone would be 15 s).

A host with `connection: local` is the machine meshdeploy runs on: no SSH, so no target, user,
key, ssh_config or host key; its settings say so (`local`, host_key LOCAL) and every client
takes the local path (pyinfra's @local connector, invoke's local runner).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from meshdeploy.config.model import Host
from meshdeploy.errors import PlanError

YES, ACCEPT_NEW, NO = "yes", "accept-new", "no"
POLICIES = (YES, ACCEPT_NEW, NO)
LOCAL = "none: connection local"  # the host_key of a local host: there is no key to check
# What OpenSSH's StrictHostKeyChecking values mean to a tool that never prompts.
_FROM_SSH_CONFIG = {"yes": YES, "ask": YES, "accept-new": ACCEPT_NEW, "no": NO, "off": NO}
FLAG = "--accept-new-host-keys"
CONNECT_TIMEOUT = 10  # seconds, unless the ssh_config or --connect-timeout says otherwise
CONNECT_TIMEOUT_ENV = "MESHDEPLOY_CONNECT_TIMEOUT"  # what --connect-timeout sets


@dataclass(frozen=True)
class SshSettings:
    """One host's connection settings, every source already applied."""

    host: str  # the cluster file's host name
    target: str  # what is dialled and looked up in ssh_config: an alias there, else address
    port: int
    user: str | None
    key: str | None
    config: str | None  # the ssh_config file read for this host, None when there is none
    sudo: bool
    host_key: str  # yes, accept-new or no
    host_key_from: str  # where the policy came from, for messages and warnings
    known_hosts: tuple[str, ...]  # UserKnownHostsFile; new keys go to the first
    hostname: str  # what ssh_config's HostName makes of target: the name known_hosts holds
    proxy_command: str | None
    local: bool = False  # connection: local (no SSH at all)
    connect_timeout: float = CONNECT_TIMEOUT  # seconds for the TCP connect and the SSH banner
    connect_timeout_from: str = "the default"

    @property
    def known_hosts_name(self) -> str:
        """The host's name in known_hosts, as OpenSSH and paramiko write it."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    def pyinfra_data(self) -> dict:
        """Host data for pyinfra's ssh connector (the @local connector reads only _sudo)."""
        if self.local:
            return {"_sudo": self.sudo}
        # known_hosts is left to pyinfra: it reads the same UserKnownHostsFile (all of them)
        # from the same ssh_config.
        data = {"ssh_hostname": self.target, "ssh_port": self.port, "_sudo": self.sudo,
                "ssh_strict_host_key_checking": self.host_key}
        if self.user:
            data["ssh_user"] = self.user
        if self.key:
            data["ssh_key"] = self.key
        if self.config:
            data["ssh_config_file"] = self.config
        # Applied after pyinfra's own fixed CONNECT_TIMEOUT and the ssh_config's: the one
        # timeout fabric gets too (connections.connection).
        data["ssh_paramiko_connect_kwargs"] = self.paramiko_timeouts()
        return data

    def paramiko_timeouts(self) -> dict:
        """paramiko's connect() arguments for the connect timeout: the TCP connect, and the SSH
        banner (the whole wait where a ProxyCommand makes the connection)."""
        return {"timeout": self.connect_timeout, "banner_timeout": self.connect_timeout}


def resolve(host: Host, accept_new: bool = False, home: str | None = None) -> SshSettings:
    """`host`'s connection settings; `home` stands in for ~ (tests)."""
    if host.local:
        return local_settings(host)
    home = home or os.path.expanduser("~")
    config = host.ssh.config or _existing(os.path.join(home, ".ssh", "config"))
    target = _target(host, config if host.ssh.config else None)
    options = _lookup(config, target) if config else {}
    policy, source = _policy(host, options, config)
    if accept_new and policy == YES:
        policy, source = ACCEPT_NEW, FLAG
    known = tuple(_expand(f, home) for f in options.get("userknownhostsfile", "").split()) \
        or (os.path.join(home, ".ssh", "known_hosts"),)
    timeout, timeout_from = connect_timeout(options, config)
    # host.sudo, not ssh.sudo: a rootless host's ssh.sudo keeps its default (true), and pyinfra
    # runs every command whose step names no _sudo through sudo when its host data says so.
    return SshSettings(host=host.name, target=target, port=host.ssh.port, user=host.ssh.user,
                       key=host.ssh.key, config=config, sudo=host.sudo, host_key=policy,
                       host_key_from=source, known_hosts=known,
                       hostname=options.get("hostname", target),
                       proxy_command=options.get("proxycommand"),
                       connect_timeout=timeout, connect_timeout_from=timeout_from)


def connect_timeout(options: dict, config: str | None) -> tuple[float, str]:
    """The connect timeout in seconds and where it came from: --connect-timeout (through the
    environment), the ssh_config's ConnectTimeout, or the default."""
    given = os.environ.get(CONNECT_TIMEOUT_ENV, "").strip()
    if given:
        seconds = parse_seconds(given)
        if seconds is None:
            raise PlanError(f"{CONNECT_TIMEOUT_ENV}={given!r} is not a number of seconds "
                            "above 0", hint="e.g. --connect-timeout 5")
        return seconds, "--connect-timeout"
    seconds = parse_seconds(options.get("connecttimeout", ""))
    if seconds is not None:
        return seconds, f"ConnectTimeout in {config}"
    return CONNECT_TIMEOUT, "the default"


def parse_seconds(value: str) -> float | None:
    """Seconds above 0 (at most a day), or None."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if 0 < seconds <= 86400 else None


def local_settings(host: Host) -> SshSettings:
    """The settings of the machine meshdeploy runs on: nothing of SSH applies, whatever
    --accept-new-host-keys or an ssh_config says."""
    return SshSettings(host=host.name, target="localhost", port=host.ssh.port, user=None,
                       key=None, config=None, sudo=host.sudo, host_key=LOCAL,
                       host_key_from=f"hosts.{host.name}.connection", known_hosts=(),
                       hostname="localhost", proxy_command=None, local=True)


def _policy(host: Host, options: dict, config: str | None) -> tuple[str, str]:
    if host.ssh.host_key is not None:
        return host.ssh.host_key, f"hosts.{host.name}.ssh.host_key"
    value = options.get("stricthostkeychecking", "").lower()
    if value in _FROM_SSH_CONFIG:
        return _FROM_SSH_CONFIG[value], f"StrictHostKeyChecking {value} in {config}"
    return YES, "the default"


def _target(host: Host, config: str | None) -> str:
    """The host name when its own ssh_config has a `Host` entry for it (aliases, ProxyCommand),
    else its address."""
    if config:
        try:
            text = Path(config).read_text()
        except OSError:
            return host.address
        for line in text.splitlines():
            words = line.split()
            if len(words) >= 2 and words[0].lower() == "host" and host.name in words[1:]:
                return host.name
    return host.address


def parse_config(config: str | None):
    """The ssh_config file parsed as pyinfra parses it (paramiko's SSHConfig with Include
    support), so pyinfra and fabric (meshdeploy.remote.connections) see the same file the same way;
    None when there is no file or it cannot be read."""
    from pyinfra.connectors.sshuserclient.config import SSHConfig

    if not config:
        return None
    try:
        stat = os.stat(config)
        seen = (config, stat.st_mtime_ns, stat.st_size)
        if seen not in _PARSED:
            with open(config, encoding="utf-8") as f:
                parsed = SSHConfig()
                parsed.parse(f)
            _PARSED[seen] = parsed
    except (OSError, UnicodeDecodeError):
        return None
    return _PARSED[seen]


# ssh_config files parsed in this process, by path as they were then (modification time and
# size; a file it includes is read when the including one is): hosts of a fleet usually share
# one file, and parsing it took 10 ms a host.
_PARSED: dict = {}


def _lookup(config: str, target: str) -> dict:
    """The ssh_config options for `target`."""
    parsed = parse_config(config)
    return dict(parsed.lookup(target)) if parsed is not None else {}


def _existing(path: str) -> str | None:
    return path if os.path.isfile(path) else None


def _expand(path: str, home: str) -> str:
    if path == "~" or path.startswith("~/"):
        return home + path[1:]
    return os.path.expanduser(path)


def no_check_warnings(settings: list[SshSettings]) -> list[str]:
    """One warning per source that turns host-key checking off, naming its hosts."""
    by_source: dict[str, list[str]] = {}
    for s in settings:
        if s.host_key == NO:
            by_source.setdefault(s.host_key_from, []).append(s.host)
    return [f"host keys are not checked for {', '.join(hosts)} ({source}): anyone on the path "
            "can impersonate the host and read what meshdeploy sends. Use yes or accept-new."
            for source, hosts in by_source.items()]
