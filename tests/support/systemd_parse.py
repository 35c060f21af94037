"""A test-side reader of what systemd makes of a unit file (systemd.service "Command lines",
systemd.unit "Quoting" and "Specifiers"): written from the documentation, independently of
core/units.py, so the escaping is checked against the rules, not against itself."""

from __future__ import annotations

WHITESPACE = " \t\n\r"
SIMPLE = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
          "\\": "\\", '"': '"', "'": "'", "s": " "}


class Expansion(str):
    """A word that still holds a systemd specifier or $VAR expansion (not a literal)."""


def _unescape(text: str, i: int) -> tuple[str, int]:
    c = text[i]
    if c in SIMPLE:
        return SIMPLE[c], i + 1
    if c == "x":
        return chr(int(text[i + 1:i + 3], 16)), i + 3
    if c in "01234567":
        return chr(int(text[i:i + 3], 8)), i + 3
    if c == "u":
        return chr(int(text[i + 1:i + 5], 16)), i + 5
    if c == "U":
        return chr(int(text[i + 1:i + 9], 16)), i + 9
    raise ValueError(f"bad escape \\{c}")


def split_words(value: str, starts: list[int] | None = None) -> list[str]:
    """extract_first_word(EXTRACT_UNQUOTE | EXTRACT_CUNESCAPE) repeated: quotes may start and
    end anywhere in a word; escapes work inside and outside quotes. `starts` collects where
    each word begins in `value`."""
    words, i, n = [], 0, len(value)
    while True:
        while i < n and value[i] in WHITESPACE:
            i += 1
        if i >= n:
            return words
        if starts is not None:
            starts.append(i)
        word, quote, started = "", None, False
        while i < n:
            c = value[i]
            if quote is None and c in WHITESPACE:
                break
            if c == "\\":
                ch, i = _unescape(value, i + 1)
                word += ch
                continue
            if quote is None and c in "\"'":
                quote, started = c, True
            elif quote is not None and c == quote:
                quote = None
            else:
                word += c
            i += 1
        if quote is not None:
            raise ValueError("unterminated quote")
        words.append(word)


def specifiers(word: str) -> str:
    """%% -> %; any other specifier makes the word an Expansion (systemd would replace it)."""
    out, i, expanded = "", 0, False
    while i < len(word):
        if word[i] == "%":
            if word[i + 1:i + 2] == "%":
                out += "%"
                i += 2
                continue
            expanded = True
        out += word[i]
        i += 1
    return Expansion(out) if expanded else out


def environment(word: str) -> str:
    """$$ -> $; $NAME or ${NAME} makes the word an Expansion."""
    out, i, expanded = "", 0, isinstance(word, Expansion)
    while i < len(word):
        if word[i] == "$":
            if word[i + 1:i + 2] == "$":
                out += "$"
                i += 2
                continue
            expanded = True
        out += word[i]
        i += 1
    return Expansion(out) if expanded else out


def exec_argv(value: str) -> list[str]:
    """ExecStart= value -> argv as the process receives it (a lone ; is refused here)."""
    starts: list[int] = []
    words = split_words(value, starts)
    if words and words[0][:1] in "-@:+!":
        raise ValueError(f"program with a prefix: {words[0]!r}")
    # config_parse_exec (src/core/load-fragment.c) looks at the raw text where a word starts:
    # an unquoted ";" followed by whitespace or the end separates commands. A ";" inside a
    # quoted word ("/a ; b") is an ordinary character.
    if any(value[s] == ";" and (s + 1 == len(value) or value[s + 1] in WHITESPACE)
           for s in starts):
        raise ValueError("a lone ; separates commands")
    return [environment(specifiers(w)) for w in words]


def env_assignment(value: str) -> tuple[str, str]:
    (word,) = split_words(value)
    name, _, text = specifiers(word).partition("=")
    return name, text


def settings(unit: str) -> list[tuple[str, str]]:
    """(key, raw value) of every setting line; sections and comments skipped; lines split on
    "\\n" only, as systemd reads them; a trailing backslash would continue a line (refused)."""
    out = []
    for line in unit.split("\n"):
        stripped = line.strip()
        if not stripped or stripped[0] in "#;" or stripped.startswith("["):
            continue
        if stripped.endswith("\\"):
            raise ValueError(f"line continuation in {line!r}")
        key, sep, value = stripped.partition("=")
        if not sep:
            raise ValueError(f"not a setting: {line!r}")
        out.append((key.strip(), value.strip()))
    return out
