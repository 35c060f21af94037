"""One batched probe per host: every role's facts gathered by a single remote command.

pyinfra runs one remote command per fact; a plan touching a dozen resources on 24 hosts would
pay for hundreds of round trips. Each role still declares small FactBase classes (pure command()
and process()); this module concatenates their commands into one script with section markers
and hands each fact back only its own lines. The probe runs as the login user; only sections
marked privileged go through `sudo -n`.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import dataclass, field

from pyinfra.api import FactBase

from meshdeploy.core import shell

MARKER = "@@meshdeploy-section "
# A number a host prints (a size, a time, a count): ASCII digits, at most 20 (2**64 has 20).
# str.isdigit() also takes "³" and "١٢٣", which int() refuses or reads as another number, and
# int() takes "1_0" and " 7" and refuses more than 4300 digits.
_UINT = re.compile(r"[0-9]{1,20}")
_SHOWN = 80  # characters of a rejected line a plan quotes
_NOTED = 3  # rejected lines a fact quotes; the rest are counted


def new_nonce() -> str:
    """A per-probe secret in every section marker: no fact's output (a file name, an Ollama
    manifest, a hostile host) can forge a section it does not know the nonce of."""
    return secrets.token_hex(16)


@dataclass
class Section:
    key: str  # unique within a probe, e.g. "models.GgufFile[gemma]"
    fact: type[FactBase]
    kwargs: dict = field(default_factory=dict)
    # Reads what only root may read (DynamicUser cache dirs under /var/cache/private): runs
    # through `sudo -n` on hosts with ssh.sudo, as the login user elsewhere.
    privileged: bool = False

    def script(self, nonce: str, index: int, sudo: bool) -> str:
        command = self.fact().command(**self.kwargs)
        if self.privileged and sudo:
            command = shell.sudo(command)
        return self.wrapped(nonce, index, command)

    @staticmethod
    def wrapped(nonce: str, index: int, command: str) -> str:
        # The marker carries the section's position, never its key (keys hold model and file
        # names); a subshell keeps one failing fact (missing binary, absent file) from ending
        # the probe.
        return (shell.command("printf", "%s\\n", marker(nonce, index)) + "\n"
                + shell.subshell(command) + " 2>/dev/null\n")


def marker(nonce: str, index: int) -> str:
    return f"{MARKER}{nonce} {index}"


# -- what every fact's process() uses on host text: it never raises ------------------------------

def uint(text: str) -> int | None:
    """The number `text` spells in ASCII digits (at most 20 of them), else None."""
    return int(text) if _UINT.fullmatch(text) else None


def quoted(text: str) -> str:
    """A host's line as a message may show it: ASCII with escapes, cut short."""
    return ascii(text[:_SHOWN]) + ("..." if len(text) > _SHOWN else "")


def damaged(rejected: list[tuple[int, str]]) -> list[str]:
    """Notes on the lines a fact skipped from a file that matters, for the plan to warn with:
    ["line 2: 'x y 3 f42cfb619b3cade9'", ..., "7 more"]; [] when none."""
    notes = [f"line {n}: {quoted(text)}" for n, text in rejected[:_NOTED]]
    if len(rejected) > _NOTED:
        notes.append(f"{len(rejected) - _NOTED} more")
    return notes


class SudoCheck(FactBase):
    """Whether `sudo -n` works for the login user: {"ok": True} or {"ok": False, "message": ...}.

    Checked in the probe of every host with ssh.sudo, since apply needs root there. In a
    composed probe it is the first line of the privileged sections' root shell (compose), whose
    refusal message it reads; alone, it runs a sudo of its own.
    """

    def command(self):
        return "sudo -n true 2>&1 && echo ok"

    def process(self, output):
        lines = [line.strip() for line in output if line.strip()]
        if lines and lines[-1] == "ok":
            return {"ok": True}
        return {"ok": False, "message": lines[-1] if lines else "sudo gave no answer"}

    @staticmethod
    def default():
        return {"ok": False, "message": "sudo gave no answer (is it installed?)"}


def compose(sections: list[Section], nonce: str, sudo: bool = False) -> str:
    """One script for the whole probe; run it as the login user (see Section.privileged).
    Privileged sections that follow one another share one `sudo -n` (each sudo costs the host
    a PAM session and a log line: on 30 hosts sharing two cores, a tenth of a plan); a SudoCheck
    right before them is answered by that same sudo (engine.planner puts them in that order)."""
    out, run = [], []
    check = None
    for i, section in enumerate(sections):
        if section.privileged and sudo:
            run.append((i, section))
            continue
        out.append(_as_root(run, nonce, check))
        run, check = [], None
        if sudo and section.fact is SudoCheck and i + 1 < len(sections) \
                and sections[i + 1].privileged:
            check = i
            continue
        out.append(section.script(nonce, i, sudo))
    out.append(_as_root(run, nonce, check))
    return "".join(out)


def _as_root(run: list[tuple[int, Section]], nonce: str, check: int | None = None) -> str:
    """Consecutive privileged sections in one root shell, each still its own marked subshell
    (its marker too: a refused sudo leaves their sections missing, as probe.split allows).
    + check: the index of a SudoCheck section, marked before the sudo: the root shell first
      says "ok", and sudo's own refusal (its stderr) is that section's output."""
    if not run:
        return ""
    inner = "".join(Section.wrapped(nonce, i, s.fact().command(**s.kwargs)) for i, s in run)
    if check is None:
        return shell.sudo(inner) + "\n"
    return (shell.command("printf", "%s\\n", marker(nonce, check)) + "\n"
            + shell.sudo("echo ok\n" + inner) + " 2>&1\n")


def split(output, sections: list[Section], nonce: str) -> dict[str, list[str]]:
    """{section key: its lines}. Only the exact marker of a later section starts it; any other
    line, one that looks like a marker included, belongs to the section it appears in. A
    section whose marker never came (its root shell did not run: sudo refused) is missing, and
    the next marker still starts the next section."""
    raw: dict[str, list[str]] = {}
    current = None
    index = 0
    prefix = f"{MARKER}{nonce} "
    for line in output:
        text = line.rstrip("\r")
        at = uint(text[len(prefix):]) if text.startswith(prefix) else None
        if at is not None and index <= at < len(sections) and text == marker(nonce, at):
            current = sections[at].key
            raw[current] = []
            index = at + 1
        elif current is not None:
            raw[current].append(line)
    return raw


def decode(sections: list[Section], raw: dict[str, list[str]]) -> dict[str, object]:
    """Each section's lines through its fact's process(); a missing section gives the default."""
    facts: dict[str, object] = {}
    for section in sections:
        fact = section.fact()
        lines = raw.get(section.key)
        facts[section.key] = fact.process(lines) if lines else fact.default()
    return facts


def fingerprint(facts: dict[str, object], volatile: tuple[str, ...] = ()) -> str:
    """A digest of the facts a saved plan was made from; volatile facts (free disk, memory,
    round trips: each role's Role.volatile) are left out, so a growing log file does not make
    a plan stale."""
    stable = {k: v for k, v in facts.items() if not k.startswith(volatile)}
    blob = json.dumps(stable, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


class DiskFree(FactBase):
    """Free bytes on the filesystem that holds `path` (or its nearest existing parent). Roles
    subclass it (a FactBase per role folder, with fixtures)."""

    _BODY = ('while [ ! -e "$p" ] && [ "$p" != / ]; do '
             'case "$p" in */*) p=${p%/*}; p=${p:-/} ;; *) p=. ;; esac; done\n'
             'df -Pk -- "$p"')  # process() reads the last line

    def command(self, path):
        return shell.script(self._BODY, p=path)

    def process(self, output):
        words = output[-1].split() if output else []
        kib = uint(words[3]) if len(words) > 3 else None
        return None if kib is None else kib * 1024


class Stored(FactBase):
    """What a role stored on the host, for its destroy hook: each existing path among `paths`,
    and each entry of a folder in `folders` whose name starts with `prefix`, with its size.

    ```python
    {"/opt/meshdeploy/models/gemma": 253116416, ...}   # bytes on disk (du -sk, as KiB * 1024)
    ```
    Empty when nothing exists. Roles subclass it (a FactBase per role folder, with fixtures).
    """

    # "$@": the paths, then "--", then the folders; PREFIX filters the folders' entries.
    _BODY = ('size(){ k=$(du -sk "$1" 2>/dev/null | cut -f1); echo "${k:-0} $1"; }\n'
             'while [ $# -gt 0 ] && [ "$1" != -- ]; do '
             '{ [ -e "$1" ] || [ -L "$1" ]; } && size "$1"; shift; done; [ $# -gt 0 ] && shift\n'
             'for f in "$@"; do for p in "$f/$PREFIX"*; do '
             '{ [ -e "$p" ] || [ -L "$p" ]; } && size "$p"; done; done; true')

    def command(self, paths=(), folders=(), prefix=""):
        return shell.script(self._BODY, args=[*paths, "--", *folders], PREFIX=prefix)

    def process(self, output):
        out = {}
        for line in output:
            size, _, path = line.partition(" ")
            kib = uint(size)
            if kib is not None and path.startswith("/"):
                out[path] = kib * 1024
        return out

    @staticmethod
    def default():
        return {}
