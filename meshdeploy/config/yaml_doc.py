"""Read a cluster file into ruamel data, refusing anything that could crash or stall the reader.

Every step runs behind one guard (meshdeploy.config.yaml_doc.parse): the read is capped, the text
is checked before ruamel sees it, and the composer counts nodes, nesting and alias expansion as
it goes, so a YAML alias bomb, a 1,000-deep list or /dev/zero is refused in milliseconds with
file:line:col instead of a traceback, a RecursionError or minutes of CPU. Whatever ruamel still
raises is turned into a located ConfigIssue; its warnings and debug prints never reach the
terminal.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import warnings
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.composer import Composer
from ruamel.yaml.constructor import RoundTripConstructor
from ruamel.yaml.error import MarkedYAMLError, YAMLError
from ruamel.yaml.events import AliasEvent, ScalarEvent
from ruamel.yaml.nodes import MappingNode, ScalarNode, SequenceNode
from ruamel.yaml.reader import ReaderError
from ruamel.yaml.scanner import RoundTripScanner

from meshdeploy.errors import ConfigError, ConfigIssue

# A real cluster file is a few KB with a few hundred values; these bounds are far above any
# real file and far below what takes ruamel or jsonschema more than a fraction of a second.
MAX_BYTES = 1 << 20
MAX_NODES = 10_000          # values and keys as written
MAX_EXPANDED = 100_000      # the same after expanding every alias
MAX_DEPTH = 64              # nesting, aliases expanded; jsonschema and ruamel recurse on it
MAX_INT_DIGITS = 4_300      # Python's int <-> str conversion limit (sys.get_int_max_str_digits)
MAX_COMMENT = 10_000        # ruamel's scanner builds a comment one character at a time (O(n^2))

CORE = "tag:yaml.org,2002:"
SCALAR_TAGS = {CORE + t for t in ("str", "int", "float", "bool", "null")}
ALLOWED_TAGS = SCALAR_TAGS | {CORE + "seq", CORE + "map"}

# What YAML itself refuses to read (ruamel's Reader.NON_PRINTABLE), found before ruamel does so
# the error says line:col rather than "position N".
NOT_YAML = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# C0 (tab and newline included), DEL and C1: never meaningful in a value that ends up in a
# command line, a systemd unit or a file name.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
LONG_COMMENT = re.compile(f"(?:^|[ \t])#[^\n]{{{MAX_COMMENT},}}", re.MULTILINE)
# ruamel's scanner checks every open flow level for each token it reads ahead (up to 1,024
# characters) to resolve a possible simple key: `[[[[...` costs ~0.6 s before the composer
# ever sees a node. Refused on sight, like the depth the composer refuses.
DEEP_FLOW = re.compile(f"(?:[\\[{{][ \t]*){{{MAX_DEPTH + 1}}}")


class Refused(Exception):
    """A problem found while composing: where, which data path, what, and what to do."""

    def __init__(self, mark: Any, path: tuple, message: str, hint: str | None = None):
        super().__init__(message)
        self.mark, self.path, self.message, self.hint = mark, path, message, hint


def parse(display: str, path: Path) -> tuple[bytes, Any]:
    """The raw bytes and the ruamel round-trip data of a cluster file; raises ConfigError."""
    raw = read_capped(display, path)
    text = decode(display, raw)
    yaml = YAML(typ="rt")
    yaml.Scanner = GuardedScanner
    yaml.Composer = GuardedComposer
    yaml.Constructor = GuardedConstructor
    sink = io.StringIO()  # ruamel reports some oddities with print(); they are not ours to show
    with warnings.catch_warnings(), contextlib.redirect_stdout(sink), \
            contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")  # ReusedAnchorWarning & co.: legal YAML, nothing to do
        try:
            node = yaml.compose(text)
        except Refused as exc:
            raise ConfigError([refused_issue(display, exc)]) from None
        except MarkedYAMLError as exc:
            raise ConfigError([yaml_issue(display, exc)]) from None
        except ReaderError as exc:
            line, col = line_col(text, exc.position or 0)
            raise ConfigError([ConfigIssue(display, line, col, "", f"YAML error: {exc.reason}",
                                           "remove the character")]) from None
        except YAMLError as exc:  # no position known: say so plainly
            raise ConfigError([ConfigIssue(display, 0, 0, "",
                                           f"YAML error: {printable(str(exc), 200)}")]) from None
        if node is None:
            return raw, None
        issues = node_issues(display, node)
        if issues:
            raise ConfigError(issues)
        constructor = yaml.constructor
        try:
            return raw, constructor.construct_document(node)
        except MarkedYAMLError as exc:
            raise ConfigError([yaml_issue(display, exc)]) from None
        except (YAMLError, ValueError, TypeError, KeyError, AttributeError) as exc:
            # The composer's checks leave nothing known that fails here; locate the rest anyway.
            mark = constructor.current.start_mark
            raise ConfigError([ConfigIssue(
                display, mark.line + 1, mark.column + 1, "",
                f"cannot read this value: {printable(str(exc), 200)}",
                "write a plain string, number, boolean, list or mapping")]) from None


def read_capped(display: str, path: Path) -> bytes:
    """The file's bytes: regular files and pipes only, at most MAX_BYTES of them."""
    def refuse(message: str, hint: str) -> ConfigError:
        return ConfigError([ConfigIssue(display, 0, 0, "", message, hint)])

    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
                what = "a character device" if stat.S_ISCHR(mode) else \
                    "a block device" if stat.S_ISBLK(mode) else "a socket" \
                    if stat.S_ISSOCK(mode) else "not a regular file"
                raise refuse(f"cannot read: {what}", "give the path of a YAML cluster file")
            raw = f.read(MAX_BYTES + 1)  # +1: tells "exactly the cap" from "more than the cap"
    except IsADirectoryError:
        raise refuse("cannot read: is a directory",
                     "give the path of a YAML cluster file, e.g. inventories/lab.yaml") from None
    except OSError as exc:
        raise refuse(f"cannot read: {exc.strerror or exc}",
                     "check the path of the cluster file") from None
    if len(raw) > MAX_BYTES:
        raise refuse(f"is larger than {MAX_BYTES >> 20} MiB; a cluster file is a few KB",
                     "check that this is the cluster file")
    return raw


def decode(display: str, raw: bytes) -> str:
    """UTF-8 text that ruamel can read without an unlocated error or a quadratic scan."""
    nul = raw.find(b"\0")
    if nul >= 0:  # binary junk is rarely UTF-8: say what it is rather than "byte 0x80"
        before = raw[:nul].decode("utf-8", "replace")
        line, col = line_col(before, len(before))
        raise ConfigError([ConfigIssue(display, line, col, "",
                                       "file contains a NUL byte: this looks like a binary file",
                                       "a cluster file is plain UTF-8 text")])
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        good = raw[: exc.start].decode("utf-8")
        line, col = line_col(good, len(good))
        raise ConfigError([ConfigIssue(
            display, line, col, "", f"file is not valid UTF-8 (byte 0x{raw[exc.start]:02x})",
            "save the file as UTF-8; is this a YAML cluster file?")]) from None
    bad = NOT_YAML.search(text)
    if bad:
        line, col = line_col(text, bad.start())
        char = bad.group()
        what = f"control character U+{ord(char):04X}, which YAML does not allow"
        raise ConfigError([ConfigIssue(display, line, col, "", f"file contains {what}",
                                       "a cluster file is plain UTF-8 text: remove it")])
    deep = DEEP_FLOW.search(text)
    if deep:
        line, col = line_col(text, deep.start())
        raise ConfigError([ConfigIssue(display, line, col, "",
                                       f"values nested deeper than {MAX_DEPTH} levels",
                                       "a cluster file is a few levels deep; check the brackets")])
    long = LONG_COMMENT.search(text)
    if long:
        line, col = line_col(text, long.start() + (long.group()[0] != "#"))
        raise ConfigError([ConfigIssue(
            display, line, col, "", f"comment longer than {MAX_COMMENT:,} characters",
            "shorten the comment or split it over several lines")])
    return text


def line_col(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of a character index."""
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


class GuardedScanner(RoundTripScanner):
    def scan_yaml_directive_value(self, start_mark: Any) -> Any:
        version = super().scan_yaml_directive_value(start_mark)
        if tuple(version) not in ((1, 1), (1, 2)):
            # ruamel asserts on 1.3 deep inside the loader, without a position.
            raise Refused(start_mark, (), f"%YAML {version[0]}.{version[1]} is not supported",
                          "write %YAML 1.2, or remove the line")
        return version


class GuardedComposer(Composer):
    """ruamel's composer, counting as it goes so that no input can outgrow the bounds above.

    Each finished node's expanded size and depth are kept by identity, so an alias costs one
    lookup however large its target, and an alias to a node still being composed is recursion.
    """

    def __init__(self, loader: Any = None) -> None:
        super().__init__(loader)
        self.nodes = 0
        self.expanded = 0
        self.sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded size, depth)
        self.frames: list[list[int]] = []  # per open node: [expanded size, deepest child]
        self.path: list[Any] = []

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.parser.peek_event()
        step = self.step(parent, index)
        self.path.append(step)
        try:
            if isinstance(event, AliasEvent):
                self.count_alias(event)
                node = super().compose_node(parent, index)
            else:
                node = self.compose_counted(event, parent, index)
            if isinstance(parent, MappingNode) and index is None:
                self.check_key(node, event)
        finally:
            self.path.pop()
        return node

    @staticmethod
    def step(parent: Any, index: Any) -> Any:
        if isinstance(parent, SequenceNode):
            return index
        if isinstance(parent, MappingNode) and isinstance(index, ScalarNode):
            return index.value
        return None  # the root, a mapping key, or a value under a key that is not a string

    def where(self) -> tuple:
        return tuple(s for s in self.path if s is not None)

    def count_alias(self, event: Any) -> None:
        target = self.anchors.get(event.anchor)
        if target is None:
            return  # ruamel raises "found undefined alias" with its position
        known = self.sizes.get(id(target))
        if known is None:
            raise Refused(event.start_mark, self.where(),
                          f"alias *{event.anchor} is inside its own anchor &{event.anchor}",
                          "a cluster file cannot hold a recursive structure: copy the values")
        size, depth = known
        self.expanded += size
        if self.expanded > MAX_EXPANDED:
            raise Refused(event.start_mark, self.where(),
                          f"alias *{event.anchor} expands the file past {MAX_EXPANDED:,} values",
                          "aliases that nest aliases multiply: is this a YAML alias bomb?")
        if len(self.frames) + depth > MAX_DEPTH:
            raise Refused(event.start_mark, self.where(),
                          f"alias *{event.anchor} nests values deeper than {MAX_DEPTH} levels",
                          "a cluster file is a few levels deep")
        if self.frames:
            top = self.frames[-1]
            top[0] += size
            top[1] = max(top[1], depth)

    def compose_counted(self, event: Any, parent: Any, index: Any) -> Any:
        self.nodes += 1
        self.expanded += 1
        if self.nodes > MAX_NODES:
            raise Refused(event.start_mark, self.where(),
                          f"the file has more than {MAX_NODES:,} values",
                          "a cluster file has a few hundred; check that this is the right file")
        if self.expanded > MAX_EXPANDED:
            raise Refused(event.start_mark, self.where(),
                          f"aliases expand the file past {MAX_EXPANDED:,} values",
                          "aliases that nest aliases multiply: is this a YAML alias bomb?")
        self.frames.append([1, 0])
        if len(self.frames) > MAX_DEPTH:
            raise Refused(event.start_mark, self.where(),
                          f"values nested deeper than {MAX_DEPTH} levels",
                          "a cluster file is a few levels deep; check the brackets")
        node = super().compose_node(parent, index)
        size, deepest = self.frames.pop()
        self.sizes[id(node)] = (size, deepest + 1)
        if self.frames:
            top = self.frames[-1]
            top[0] += size
            top[1] = max(top[1], deepest + 1)
        if isinstance(event, ScalarEvent):
            self.check_scalar(node, event)
        return node

    def check_scalar(self, node: ScalarNode, event: Any) -> None:
        tag = str(node.tag)
        explicit = event.ctag is not None and str(event.ctag) != "!"
        if explicit and tag != CORE + "str":
            implicit = str(self.resolver.resolve(ScalarNode, node.value, (True, False)))
            fits = implicit == tag or (tag == CORE + "float" and implicit == CORE + "int")
            if tag in SCALAR_TAGS and not fits:
                raise Refused(node.start_mark, self.where(),
                              f"{show_scalar(node.value)} is not a valid {short_tag(tag)}",
                              f"remove the {short_tag(tag)} tag, or quote the value")
        if tag == CORE + "int" and sum(c.isdigit() for c in node.value) > MAX_INT_DIGITS:
            raise Refused(node.start_mark, self.where(),
                          f"integer with more than {MAX_INT_DIGITS:,} digits",
                          "no setting needs a number this large")

    def compose_sequence_node(self, anchor: Any) -> Any:
        self.check_collection_tag(self.parser.peek_event(), CORE + "seq")
        return super().compose_sequence_node(anchor)

    def compose_mapping_node(self, anchor: Any) -> Any:
        self.check_collection_tag(self.parser.peek_event(), CORE + "map")
        return super().compose_mapping_node(anchor)

    def compose_scalar_node(self, anchor: Any) -> Any:
        event = self.parser.peek_event()
        tag = event.ctag
        if tag is not None and str(tag) != "!" and str(tag) not in SCALAR_TAGS:
            if str(tag) in ALLOWED_TAGS:
                raise Refused(event.start_mark, self.where(),
                              f"tag {short_tag(str(tag))} does not fit a single value",
                              "remove the tag")
            raise self.bad_tag(event, str(tag))
        return super().compose_scalar_node(anchor)

    def check_collection_tag(self, event: Any, wanted: str) -> None:
        tag = event.ctag
        if tag is None or str(tag) in ("!", wanted):
            return
        if str(tag) in ALLOWED_TAGS:
            kind = "a list" if wanted == CORE + "seq" else "a mapping"
            raise Refused(event.start_mark, self.where(),
                          f"tag {short_tag(str(tag))} does not fit {kind}", "remove the tag")
        raise self.bad_tag(event, str(tag))

    def bad_tag(self, event: Any, tag: str) -> Refused:
        return Refused(event.start_mark, self.where(), f"tag {short_tag(tag)} is not supported",
                       "a cluster file holds mappings, lists, strings, numbers and booleans: "
                       "remove the tag")

    def check_key(self, node: Any, event: Any) -> None:
        tag = str(node.tag)
        if isinstance(node, ScalarNode) and tag in (CORE + "str", CORE + "merge"):
            return
        if isinstance(node, ScalarNode):
            kind = short_tag(tag).lstrip("!")
            what = f"{show_scalar(node.value)} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
            hint = f"quote it: '{node.value}'" if node.value else "give the key a name"
        else:
            what = "a list" if isinstance(node, SequenceNode) else "a mapping"
            hint = "write a plain name as the key"
        raise Refused(node.start_mark, self.where(), f"mapping key {what}; keys must be strings",
                      hint)


class GuardedConstructor(RoundTripConstructor):
    """Remembers the node being built, so that an unexpected failure still has a position."""

    current: Any = None

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        self.current = node
        return super().construct_object(node, deep)


def node_issues(display: str, root: Any) -> list[ConfigIssue]:
    """Duplicate keys and control characters, on the node graph (each node visited once).

    The loaded data keeps only one of two duplicate keys, and a string's position is exact here.
    """
    issues: list[ConfigIssue] = []
    seen_nodes: set[int] = set()

    def located(mark: Any, path: tuple, message: str, hint: str) -> ConfigIssue:
        return ConfigIssue(display, mark.line + 1, mark.column + 1, render_path(path), message,
                           hint)

    def visit(node: Any, path: tuple) -> None:  # recursion is bounded by MAX_DEPTH
        if id(node) in seen_nodes:
            return
        seen_nodes.add(id(node))
        if isinstance(node, ScalarNode):
            if str(node.tag) == CORE + "str":
                bad = CONTROL.search(node.value)
                if bad:
                    issues.append(located(node.start_mark, path, control_message(bad.group()),
                                          control_hint(node, bad.group())))
        elif isinstance(node, MappingNode):
            first: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key = str(key_node.value)
                here = path + (key,)
                if key in first and key != "<<":
                    mark = first[key].start_mark
                    issues.append(located(
                        key_node.start_mark, here,
                        f"duplicate key '{printable(key)}' (first defined at line "
                        f"{mark.line + 1})",
                        "keep one of the two; YAML would silently use only the last"))
                else:
                    first[key] = key_node
                visit(key_node, here)
                visit(value_node, here)
        elif isinstance(node, SequenceNode):
            for i, item in enumerate(node.value):
                visit(item, path + (i,))

    visit(root, ())
    return issues


def control_message(char: str) -> str:
    names = {"\n": "a newline", "\t": "a tab", "\r": "a carriage return"}
    return f"contains {names.get(char, f'control character U+{ord(char):04X}')}"


def control_hint(node: ScalarNode, char: str) -> str:
    if char == "\n" and node.style in ("|", ">"):
        return "a block scalar (| or >) ends with a newline: use |- or >-, or a plain string"
    return "values are passed to programs and unit files: write it on one line, without " \
           "control characters"


def yaml_issue(display: str, exc: MarkedYAMLError) -> ConfigIssue:
    mark = exc.problem_mark or exc.context_mark
    line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
    problem = exc.problem or "malformed YAML"
    message = f"YAML syntax error: {problem}"
    if exc.context and exc.context_mark:
        message += f" ({exc.context} started at line {exc.context_mark.line + 1})"
    return ConfigIssue(display, line, col, "", message,
                       "check indentation, colons and quotes around this line")


def refused_issue(display: str, exc: Refused) -> ConfigIssue:
    return ConfigIssue(display, exc.mark.line + 1, exc.mark.column + 1, render_path(exc.path),
                       exc.message, exc.hint)


def render_path(path: tuple) -> str:
    if len(path) > 12:  # a refused 64-deep nesting: its start and end say enough
        return f"{render_path(path[:6])}...{render_path(path[-3:])}"
    out = ""
    for step in path:
        if isinstance(step, int):
            out += f"[{step}]"
        else:
            step = printable(str(step))
            out += f".{step}" if out else step
    return out


def printable(text: str, limit: int = 80) -> str:
    """Text safe to print in one line of a message: control characters escaped, length capped."""
    if CONTROL.search(text):
        text = CONTROL.sub(lambda m: repr(m.group())[1:-1], text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def show_scalar(value: str) -> str:
    return f"'{printable(value)}'"


def short_tag(tag: str) -> str:
    return "!!" + tag[len(CORE):] if tag.startswith(CORE) else printable(tag, 40)
