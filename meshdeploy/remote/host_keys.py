"""Why a host's key was refused, in OpenSSH's terms: the fingerprint it offered and what to do.

pyinfra reports a refused key as a one-line ConnectError without the key ("SSH host key error
(Host key for node1 does not match.)", "StrictPolicy: No host key for ..."). The session hands
over the key the server offered; this module compares it with the host's known_hosts files, as
paramiko did, and says which of the two happened.
"""

from __future__ import annotations

from meshdeploy.core import shell
from meshdeploy.errors import ConnectError
from meshdeploy.remote.ssh_settings import FLAG, SshSettings


class HostKeyError(ConnectError):
    """A host's SSH key is unknown (and the policy is strict) or differs from known_hosts.
    Nothing was sent to any host: connections are checked before the probe."""


def fingerprint(key) -> str:
    """`SHA256:<base64>`, as `ssh-keygen -l` and ssh's prompts print it."""
    return key.fingerprint


def known_keys(settings: SshSettings) -> dict | None:
    """The keys known_hosts holds for the host, by key type; None when it holds none."""
    from paramiko import HostKeys

    keys = HostKeys()
    for path in settings.known_hosts:
        try:
            keys.load(path)
        except (OSError, ValueError, IndexError):
            continue  # missing or unreadable: as paramiko, which then knows no key
    found = keys.lookup(settings.known_hosts_name)
    return dict(found) if found else None


def classify(settings: SshSettings, key) -> str | None:
    """"changed", "unknown" or None (the key is not why the connection failed)."""
    if key is None:
        return None
    known = known_keys(settings)
    if known is None:
        return "unknown" if settings.host_key == "yes" else None
    return None if known.get(key.get_name()) == key else "changed"


def _key_file(key) -> str:
    kind = key.get_name().removeprefix("ssh-").split("-")[0]
    return f"/etc/ssh/ssh_host_{kind}_key.pub"


def host_key_error(failures: dict) -> HostKeyError | None:
    """One error for every host whose key was refused, naming the other failures
    ({host: (SshSettings, offered key, message)}); None when no failure came from a host key."""
    lines, hints, others = [], [], []
    for name, (settings, key, error) in sorted(failures.items()):
        kind = classify(settings, key)
        offered = f"{settings.known_hosts_name} offered {key.get_name()} key " \
                  f"{fingerprint(key)}" if key is not None else ""
        check = f"ssh-keygen -lf {_key_file(key)}" if key is not None else ""
        if kind == "changed":
            lines.append(f"host key of {name} changed: {offered}, but "
                         f"{settings.known_hosts[0]} holds another key for it")
            hints.append(f"if {name} was reinstalled or its keys regenerated, confirm the new "
                         f"fingerprint on it ({check}), remove the old key with "
                         f"`ssh-keygen -R {shell.quote(settings.known_hosts_name)} -f "
                         f"{shell.quote(settings.known_hosts[0])}` and rerun; if not, do not "
                         "connect: someone may be intercepting the connection")
        elif kind == "unknown":
            lines.append(f"host key of {name} is unknown: {offered}, not in "
                         f"{' or '.join(settings.known_hosts)} (host_key yes: "
                         f"{settings.host_key_from})")
            hints.append(f"confirm the fingerprint on {name} ({check}), then rerun with {FLAG} "
                         f"or set hosts.{name}.ssh.host_key: accept-new to record it")
        else:
            others.append(f"{name}: {error}")
    if not lines:
        return None
    message = "\n".join(lines) + "\nnothing was changed on any host"
    if others:
        message += f"; also failed to connect: {'; '.join(others)}"
    return HostKeyError(message, hint="\n  hint: ".join(hints))
