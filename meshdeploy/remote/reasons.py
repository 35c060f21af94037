"""Why a host could not be reached, in the words a person acts on: "connection refused",
"timed out", "no route to host" (the OS's own), never a library's internal state such as
paramiko's "No existing session". Both SSH stacks (pyinfra's connector in
meshdeploy.remote.session, fabric in meshdeploy.remote.connections) report through `reason`.

paramiko and pyinfra wrap the socket's error (NoValidConnectionsError holds one per address;
pyinfra raises its own ConnectError inside the `except`), so the error that says why is found
by walking the chain back. Behind a ProxyCommand (`ip netns exec ... nc`, ProxyJump's ssh -W)
the socket error happens in the proxy: what it printed on stderr before it exited is the reason,
and paramiko only sees the connection close before the SSH banner.
"""

from __future__ import annotations

import errno
import os
import select
import socket

# paramiko's words when the transport ends before or during the SSH handshake.
_CLOSED_EARLY = ("No existing session", "Error reading SSH protocol banner")
_BY_ERRNO = {
    errno.ECONNREFUSED: "connection refused",
    errno.ETIMEDOUT: "timed out",
    errno.EHOSTUNREACH: "no route to host",
    errno.ENETUNREACH: "network is unreachable",
    errno.ECONNRESET: "connection reset",
}
# What a proxy such as nc or ssh prints, matched case-insensitively.
_PROXY_WORDS = (("connection refused", "connection refused"), ("timed out", "timed out"),
                ("no route to host", "no route to host"),
                ("network is unreachable", "network is unreachable"),
                ("could not resolve", "could not resolve hostname"),
                ("name or service not known", "could not resolve hostname"))


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        errors = getattr(exc, "errors", None)  # paramiko's NoValidConnectionsError
        if isinstance(errors, dict) and errors:
            yield from _chain(next(iter(errors.values())))
        exc = exc.__cause__ or exc.__context__


def _first_line(text: str) -> str:
    text = text.strip()
    return text.splitlines()[0] if text else ""


def from_proxy(said: str) -> str | None:
    """The reason in a proxy's stderr (`nc: connect to 127.0.0.1 port 22 (tcp) failed:
    Connection refused` -> "connection refused (ProxyCommand: nc: ...)"), or None when it said
    nothing (proxy_stderr says so when the proxy exited)."""
    said = _first_line(said)
    if not said:
        return None
    lower = said.lower()
    for words, meaning in _PROXY_WORDS:
        if words in lower:
            return f"{meaning} (ProxyCommand: {said})"
    if said.endswith("and said nothing"):
        return f"the ProxyCommand could not connect before SSH started: {said}"
    return f"ProxyCommand: {said}"


def of_client(exc: BaseException, client) -> str:
    """Why a paramiko `client`'s connect failed with `exc`: reason() with what its transport
    thread saved and its ProxyCommand printed. (Where the SSH banner times out in the
    transport's own thread, the caller sees only "No existing session"; the timeout is the
    transport's saved exception.)"""
    if client is None:
        return reason(exc)
    transport = client.get_transport()
    saved = None
    if transport is not None:
        # paramiko's start_client stops waiting at the connect timeout, the same moment the
        # banner's wait in the transport's thread ends: let that thread say why first.
        try:
            transport.join(2)
        except RuntimeError:  # never started
            pass
        saved = getattr(transport, "saved_exception", None)
    return reason(exc, proxy_stderr(client), saved)


def reason(exc: BaseException, proxy_said: str = "", saved: BaseException | None = None) -> str:
    """One line saying why a connection failed: the socket's error where there is one (in
    `saved`, the transport thread's, first), else what the ProxyCommand printed, else the
    library's first line (an early close said as such)."""
    links = ([*_chain(saved)] if saved is not None else []) + [*_chain(exc)]
    for link in links:
        if isinstance(link, (socket.timeout, TimeoutError)):
            return "timed out"
        if isinstance(link, socket.gaierror):
            return f"could not resolve hostname ({link.strerror or link})"
        if isinstance(link, OSError) and link.errno in _BY_ERRNO:
            return _BY_ERRNO[link.errno]
    from_stderr = from_proxy(proxy_said)
    if from_stderr:
        return from_stderr
    for link in links:
        text = _first_line(str(link))
        if "timeout" in text.lower() or "timed out" in text.lower():
            return "timed out"
        if isinstance(link, OSError) and link.strerror:
            return link.strerror[:1].lower() + link.strerror[1:]
    text = _first_line(str(exc)) or type(exc).__name__
    if text.startswith(_CLOSED_EARLY):
        return ("the connection closed before SSH started: host down, sshd not running or "
                "ProxyCommand failed")
    return text


def proxy_stderr(client) -> str:
    """What the ProxyCommand of a paramiko client's transport printed on stderr so far, without
    waiting for more ("" without a proxy or when it said nothing)."""
    try:
        sock = client.get_transport().sock
        process = sock.process
    except Exception:  # no transport, or a plain socket: no proxy
        return ""
    stream = getattr(process, "stderr", None)
    if stream is None:
        return ""
    try:
        # A proxy that exited has flushed what it said; one still running gets a moment.
        process.wait(timeout=0.5)
    except Exception:  # still running (a silent path): read what is there
        pass
    out = b""
    try:
        while select.select([stream], [], [], 0)[0]:
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            out += chunk
    except (OSError, ValueError):  # closed by paramiko's own close
        pass
    said = out.decode("utf-8", "replace").strip()
    if said or process.returncode is None or process.returncode < 0:
        return said  # (a signal: paramiko's close ended it, it did not fail by itself)
    # OpenBSD's nc (the lab's `ip netns exec ... nc`) says nothing when its connect fails.
    command = " ".join(getattr(sock, "cmd", None) or ["the ProxyCommand"])
    return f"`{command}` exited with status {process.returncode} and said nothing"
