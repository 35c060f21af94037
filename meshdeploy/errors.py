"""One error tree for the whole tool, with the exit code each error ends the process with.

The codes are part of the command-line contract (docs/cluster-file.md lists them), so scripts
can tell "your file is wrong" from "a host was unreachable" without parsing text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OK = 0
ERROR = 1
CHANGES = 2  # only with --detailed-exitcode: the plan has changes
CONFIG = 3
CONNECT = 4
APPLY = 5
STALE_PLAN = 6
ABORTED = 7
LOCKED = 8  # another apply or destroy holds the cluster's lock
DEGRADED = 9  # status: a host or a service is away, every llama-server answers
DOWN = 10  # status: a llama-server does not answer (or its host cannot be reached)
INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

EXIT_CODES = {
    "OK": OK,
    "ERROR": ERROR,
    "CHANGES": CHANGES,
    "CONFIG": CONFIG,
    "CONNECT": CONNECT,
    "APPLY": APPLY,
    "STALE_PLAN": STALE_PLAN,
    "ABORTED": ABORTED,
    "LOCKED": LOCKED,
    "DEGRADED": DEGRADED,
    "DOWN": DOWN,
    "INTERRUPTED": INTERRUPTED,
}


class MeshdeployError(Exception):
    """Base of every error the tool reports without a traceback."""

    exit_code = ERROR

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message

    def render(self, verbose: bool = False) -> str:
        """Message plus the hint, as the CLI prints it."""
        text = str(self) if not verbose else self.message
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a cluster file; line and col are 1-based, 0 when unknown."""

    file: str
    line: int
    col: int
    path: str
    message: str
    hint: str | None = None

    def location(self) -> str:
        if self.line:
            return f"{self.file}:{self.line}:{self.col}"
        return self.file

    def __str__(self) -> str:
        where = self.location()
        if self.path:
            return f"{where}: {self.path}: {self.message}"
        return f"{where}: {self.message}"

    def render(self) -> str:
        text = str(self)
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class ConfigError(MeshdeployError):
    """The cluster file is wrong; holds every issue found, the most relevant first."""

    exit_code = CONFIG

    def __init__(self, issues: list[ConfigIssue]):
        if not issues:
            raise ValueError("ConfigError needs at least one issue")
        self.issues = list(issues)
        super().__init__(str(self.issues[0]), self.issues[0].hint)

    def __str__(self) -> str:
        text = str(self.issues[0])
        rest = len(self.issues) - 1
        if rest:
            text += f"\n{rest} more error{'s' if rest > 1 else ''} (--verbose)"
        return text

    def render(self, verbose: bool = False) -> str:
        if verbose:
            return "\n".join(issue.render() for issue in self.issues)
        text = self.issues[0].render()
        rest = len(self.issues) - 1
        if rest:
            text += f"\n{rest} more error{'s' if rest > 1 else ''} (--verbose)"
        return text


class PlanError(MeshdeployError):
    """The plan cannot be computed (facts missing, a host in an impossible state, ...)."""

    exit_code = ERROR


class StalePlanError(MeshdeployError):
    """A saved plan no longer matches the cluster file or the hosts it was computed from."""

    exit_code = STALE_PLAN


class ConnectError(MeshdeployError):
    """A host could not be reached or logged into."""

    exit_code = CONNECT


class ApplyError(MeshdeployError):
    """A change failed on a host while applying."""

    exit_code = APPLY


class AbortedError(MeshdeployError):
    """The user declined the confirmation prompt."""

    exit_code = ABORTED


# What a terminal acts on instead of showing: C0 controls but tab and newline, DEL, and C1
# (U+009B is CSI and U+009D OSC to a terminal that reads 8-bit controls, as ESC [ and ESC ]).
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_text(text: str) -> str:
    """What a host sent (a log line, a command's output, an error), made inert for the terminal:
    every control character but tab and newline written as an escape (`\\x1b`, `\\x9b`, `\\r`), so
    the reader sees that it was there and the terminal runs no sequence of the host's. Every
    error meshdeploy prints passes through it (cli), as do logs, exec and live progress."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)
