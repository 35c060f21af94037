"""Executable runbooks: the steps of a docs/runbooks/*.md file, as a test runs them.

The format is defined in docs/runbooks/README.md. In short:

- a fenced ```sh block is one step: its commands run in order in one bash (`set -e`, `pipefail`),
  in the folder that holds the cluster file `cluster.yaml`;
- HTML comments right after a block say what it must show: `<!-- expect: TEXT -->` (stdout or
  stderr contains TEXT), `<!-- expect-not: TEXT -->`, `<!-- expect-exit: N -->` (default 0);
- a fenced ```yaml block whose first line is `# cluster.yaml: set PATH` is an edit of the
  cluster file: the value at PATH (dotted keys, list indexes as numbers) becomes the block's
  YAML; `# cluster.yaml: delete PATH` removes that key;
- every other block (```text, ```yaml without that line, ...) is an illustration.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from io import StringIO
from pathlib import Path

CLUSTER_FILE = "cluster.yaml"

_FENCE = re.compile(r"^(```+|~~~+)\s*([\w-]*)(.*)$")
_MARKER = re.compile(r"^<!--\s*(expect|expect-not|expect-exit)\s*:\s*(.*?)\s*-->\s*$")
_EDIT = re.compile(rf"^#\s*{re.escape(CLUSTER_FILE)}:\s*(\w+)\s+(\S+)\s*$")
_PATH = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


class RunbookError(ValueError):
    """A runbook that does not follow the format; the message names file:line."""


@dataclass
class Step:
    kind: str                     # "sh" or "edit"
    line: int                     # line of the opening fence, 1-based
    text: str                     # the commands, or the YAML of an edit
    action: str = ""              # edit: "set" or "delete"
    path: tuple = ()              # edit: keys (str) and list indexes (int)
    expect: list[str] = field(default_factory=list)
    expect_not: list[str] = field(default_factory=list)
    exit_code: int = 0

    def describe(self) -> str:
        if self.kind == "edit":
            return f"line {self.line}: {CLUSTER_FILE}: {self.action} {'.'.join(map(str, self.path))}"
        return f"line {self.line}: {self.text.strip()}"


@dataclass
class Runbook:
    path: Path
    title: str
    steps: list[Step]


_LISTED = re.compile(r"^\|\s*\[([\w.-]+\.md)\]\(\1\)")


def order(folder: Path) -> list[str]:
    """The runbooks in the order of README.md's table; every runbook must be listed there."""
    folder = Path(folder)
    listed = [m.group(1) for ln in (folder / "README.md").read_text().splitlines()
              if (m := _LISTED.match(ln))]
    present = sorted(p.name for p in folder.glob("*.md") if p.name != "README.md")
    missing, extra = set(present) - set(listed), set(listed) - set(present)
    if missing or extra or len(listed) != len(set(listed)):
        raise RunbookError(f"{folder / 'README.md'}: its table must list each runbook once; "
                           f"missing {sorted(missing)}, not found {sorted(extra)}")
    return listed


def parse(path: Path) -> Runbook:
    return parse_text(Path(path).read_text(), Path(path))


def parse_text(text: str, path: Path = Path("<runbook>")) -> Runbook:
    lines = text.splitlines()
    title = next((ln[2:].strip() for ln in lines if ln.startswith("# ")), "")
    steps: list[Step] = []
    last_block: Step | None = None  # the executable block the next markers belong to
    after_block = False             # only blank lines and markers since the last block
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        marker = _MARKER.match(line.strip())
        if fence:
            start, closer = i + 1, fence.group(1)
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith(closer):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise RunbookError(f"{path}:{start}: the block opened here is never closed")
            step = _step(path, start, fence.group(2), body)
            if step is not None:
                steps.append(step)
            last_block, after_block = step, True
        elif marker:
            if not after_block or last_block is None or last_block.kind != "sh":
                raise RunbookError(f"{path}:{i + 1}: `{line.strip()}` must follow a ```sh block")
            _mark(path, i + 1, last_block, marker.group(1), marker.group(2))
        elif line.strip():
            after_block = False
        i += 1
    return Runbook(Path(path), title, steps)


def _step(path: Path, line: int, lang: str, body: list[str]) -> Step | None:
    if lang == "sh":
        if not "".join(body).strip():
            raise RunbookError(f"{path}:{line}: empty ```sh block")
        return Step("sh", line, "\n".join(body) + "\n")
    if lang == "yaml" and body and body[0].lstrip().startswith(f"# {CLUSTER_FILE}:"):
        edit = _EDIT.match(body[0].strip())
        if not edit or edit.group(1) not in ("set", "delete") or not _PATH.match(edit.group(2)):
            raise RunbookError(f"{path}:{line + 1}: expected `# {CLUSTER_FILE}: set PATH` or "
                               f"`# {CLUSTER_FILE}: delete PATH` (PATH like servers.main.ctx_size)")
        action, dotted = edit.group(1), edit.group(2)
        rest = "\n".join(body[1:]).strip()
        if action == "set" and not rest:
            raise RunbookError(f"{path}:{line}: `set {dotted}` needs the new YAML below it")
        if action == "delete" and rest:
            raise RunbookError(f"{path}:{line}: `delete {dotted}` takes no YAML")
        keys = tuple(int(p) if p.isdigit() else p for p in dotted.split("."))
        return Step("edit", line, "\n".join(body[1:]) + "\n", action, keys)
    return None


def _mark(path: Path, line: int, step: Step, kind: str, value: str) -> None:
    if not value:
        raise RunbookError(f"{path}:{line}: `{kind}:` needs a value")
    if kind == "expect":
        step.expect.append(value)
    elif kind == "expect-not":
        step.expect_not.append(value)
    else:
        if not value.isdigit():
            raise RunbookError(f"{path}:{line}: expect-exit takes a number, not {value!r}")
        step.exit_code = int(value)


def file_before(folder: Path, name: str, cluster_file: Path, base_text: str, adapt=str) -> None:
    """Write the cluster file as runbook `name` finds it: `base_text` with the edits of every
    runbook before it (README.md's order) applied, each edit's YAML passed through `adapt`."""
    cluster_file.write_text(base_text)
    for earlier in order(folder):
        if earlier == name:
            return
        for step in parse(Path(folder) / earlier).steps:
            if step.kind == "edit":
                apply_edit(replace(step, text=adapt(step.text)), cluster_file)
    raise RunbookError(f"{name} is not in {Path(folder) / 'README.md'}")


# ---- applying an edit ---------------------------------------------------------------------------

def apply_edit(step: Step, cluster_file: Path) -> None:
    """Set or delete step.path in the cluster file, keeping its comments and layout."""
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.indent(mapping=2, sequence=4, offset=2)
    doc = yaml.load(cluster_file.read_text())
    *parents, last = step.path
    node = doc
    for key in parents:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            raise RunbookError(f"{step.describe()}: {CLUSTER_FILE} has no {key!r} on that path")
    if step.action == "delete":
        try:
            del node[last]
        except (KeyError, IndexError, TypeError):
            raise RunbookError(f"{step.describe()}: nothing to delete")
    else:
        node[last] = yaml.load(step.text)
    out = StringIO()
    yaml.dump(doc, out)
    cluster_file.write_text(out.getvalue())
