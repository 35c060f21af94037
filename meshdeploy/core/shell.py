"""The one place where values become shell text.

Every remote command meshdeploy runs is built here: from an argv list whose words are quoted
with shlex (pyinfra does the same with StringCommand/QuoteString), or from a fixed script body
whose only inputs are variables assigned, quoted, at its top and referenced as "$NAME". Nothing
else in the code base quotes or splices a value into shell; a value that cannot travel as a
shell word (a NUL byte, text that is not valid Unicode) is refused with PlanError, never sent.

```python
command("git", "-C", "/opt/x y", "rev-parse", "HEAD")   # git -C '/opt/x y' rev-parse HEAD
command("systemctl", "restart", unit, AND, "echo", "ok")  # operators are Raw, never values
script('[ -d "$SRC/.git" ] || exit 0', SRC="/opt/x y")   # SRC='/opt/x y'\n[ -d ...
```
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from meshdeploy.errors import PlanError


class Raw(str):
    """Shell text the code itself writes: an operator, a redirection, a `$(...)` of fixed text,
    a script body. Never built from a value."""


AND = Raw("&&")
OR = Raw("||")
PIPE = Raw("|")
THEN = Raw(";")
QUIET = Raw("2>/dev/null")
TO_STDERR = Raw(">&2")

# The core's own script templates (each file's leading comment names its inputs).
TEMPLATES = Path(__file__).with_name("templates")
# A line that only tells shellcheck something (tests/unit/test_shellcheck.py): not sent to hosts.
_DIRECTIVE = re.compile(r"\s*# shellcheck ")


def body(path: Path) -> Raw:
    """The fixed script text of a .sh template: its leading comment lines (what it does, its
    inputs) and its shellcheck directives dropped; they are for readers and the linter."""
    lines = path.read_text().splitlines()
    while lines and (lines[0].startswith("#") or not lines[0].strip()):
        lines.pop(0)
    return Raw("\n".join(line for line in lines if not _DIRECTIVE.match(line)))


# md_systemd_run OPTIONS... -- COMMAND ARGS...: systemd-run whose unit runs exactly the words
# after `--` (systemd would expand "${VAR}" in them); a prelude for scripts that start units.
SYSTEMD_RUN = body(TEMPLATES / "systemd-run.sh")
# md_sha256 FILE: its sha256 by the fastest hasher the host has; a prelude for scripts that
# verify what they downloaded or packed.
SHA256 = body(TEMPLATES / "sha256.sh")
# md_owner UNIT ADDRESS PORT: whether every listener there is the unit's own (MANAGER says how
# the unit runs); a prelude for scripts that send an API key (bench, status).
LISTENER_OWNER = body(TEMPLATES / "listener-owner.sh")

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODE = re.compile(r"[0-7]{3,4}")


def _text(value, what: str = "a value") -> str:
    if isinstance(value, bool) or value is None:
        raise TypeError(f"{what}: {value!r} is not a shell word")
    text = value if isinstance(value, str) else str(value)
    if "\0" in text:
        raise PlanError(f"{what} {text!r} contains a NUL byte, which no command line can carry",
                        hint="remove it from the cluster file")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PlanError(f"{what} {text!r} is not valid Unicode text",
                        hint="use UTF-8 text in the cluster file") from None
    return text


def quote(value, what: str = "a value") -> str:
    """One shell word that the shell hands back as exactly `value` (str, int or float)."""
    if isinstance(value, Raw):
        raise TypeError("quote() of Raw shell text: pass the value, not shell")
    return shlex.quote(_text(value, what))


def join(argv) -> str:
    """A command line: every item a quoted word, except Raw items (fixed shell text)."""
    out = ""
    for a in argv:
        word = a if isinstance(a, Raw) else quote(a)
        # A separator sits on the word before it, as people write it: `a 2>/dev/null; b`.
        out += word if (not out or word == THEN) else " " + word
    return out


def split(text: str) -> list[str]:
    """A command line back into its words (how paramiko reads an ssh_config ProxyCommand)."""
    return shlex.split(text)


def command(*argv) -> str:
    """join(argv) for argv given inline."""
    return join(argv)


def assign(name: str, value) -> str:
    """NAME=<quoted value>: how a script receives an input."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a shell variable name")
    return f"{name}={quote(value, name)}"


def script(body: str, args=None, prelude: str = "", **variables) -> str:
    """A fixed script body run with its inputs assigned above it.

    + body: fixed text; it reads its inputs as "$NAME" (and "$@" for args)
    + args: a list of values that become the positional parameters ("$@") via `set --`
    + prelude: fixed text put before the body (shell functions it calls, e.g. progress.SHELL)
    + variables: NAME=value; None is the empty string
    """
    lines = [assign(k, "" if v is None else v) for k, v in variables.items()]
    if args is not None:
        lines.append(join(["set", "--", *args]) if args else "set --")
    if prelude:
        lines.append(prelude.strip("\n"))
    return "\n".join([*lines, body.strip("\n")])


def template(path: Path, args=None, prelude: str = "", **variables) -> str:
    """script() of a .sh file under a templates/ folder (the core's or a role's; see body())."""
    return script(body(path), args=args, prelude=prelude, **variables)


def heredoc(content: str) -> tuple[str, str]:
    """(tag, body) for a quoted heredoc carrying `content` literally: the tag never occurs in it."""
    content = _text(content, "file content")
    tag = "MESHDEPLOY_EOF"
    while tag in content:
        tag += "_"
    return tag, content if content.endswith("\n") else content + "\n"


def assign_text(name: str, content: str) -> str:
    """NAME=<content> through a quoted heredoc: a script that another script runs (`sh -c
    "$NAME"`) stays readable in the command, not quoted a second time."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a shell variable name")
    tag, body = heredoc(content)
    return f"{name}=$(cat <<'{tag}'\n{body}{tag}\n)"


def write_file(path: str, content: str, mode: str = "0644") -> str:
    """Atomic write through a temporary name; the content travels in a quoted heredoc."""
    if not _MODE.fullmatch(mode):
        raise ValueError(f"{mode!r} is not an octal file mode")
    tag, body = heredoc(content)
    tmp = f"{path}.meshdeploy-tmp"
    parent = path.rsplit("/", 1)[0] or "/"
    return (command("mkdir", "-p", parent, AND, "cat") + f" > {quote(tmp)} <<'{tag}'\n"
            f"{body}{tag}\n" + command("chmod", mode, tmp, AND, "mv", "-f", tmp, path))


def sudo(script_text: str) -> str:
    """Run fixed script text as root without ever prompting (sudo -n)."""
    return command("sudo", "-n", "sh", "-c", script_text)


def subshell(script_text: str) -> str:
    """( script ): its exit, `set -e` and variables stay inside."""
    return f"( {script_text}\n)"
