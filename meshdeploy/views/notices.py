"""One-line notices on stderr, about one host or about the run, as the commands print them
(validate's warnings; logs' and exec's hosts, which fabric reaches directly):
`node2: unreachable (Connection refused)`."""

from __future__ import annotations

from meshdeploy.errors import terminal_text


def warning(text: str) -> str:
    return f"warning: {text}"


def unreachable(host: str, reason: str) -> str:
    return f"{host}: unreachable ({terminal_text(reason)})"


def folders_unread(host: str, reason: str) -> str:
    """A rootless host whose login user's folders (its layout) could not be read."""
    return f"{host}: cannot read the login user's folders ({terminal_text(reason)})"


def logs_failed(host: str, exited: int, said: str) -> str:
    return f"{host}: reading the logs failed (exit {exited}): {terminal_text(said)}"


def stream_ended(host: str) -> str:
    return f"{host}: log stream ended"
