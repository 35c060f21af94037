"""The cluster file as read: its YAML with positions, so any data path points back to
file:line:col."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ruamel.yaml.scalarbool import ScalarBoolean

from meshdeploy.config import yaml_doc
from meshdeploy.config.yaml_doc import render_path
from meshdeploy.errors import ConfigError, ConfigIssue


class Document:
    """The parsed file plus what is needed to turn a data path back into file:line:col."""

    def __init__(self, display: str, path: Path, raw: bytes, root: Any):
        self.display = display
        self.path = path
        self.raw = raw
        self.root = root

    @classmethod
    def read(cls, path: str | Path) -> Document:
        display = str(path)
        raw, root = yaml_doc.parse(display, Path(path))
        if not isinstance(root, dict):
            what = "empty" if root is None else f"a {yaml_type(root)}"
            raise ConfigError([ConfigIssue(
                display, 1, 1, "", f"the cluster file is {what}; expected a mapping",
                "start from inventories/lab.yaml: it needs at least cluster, llama_cpp.ref "
                "and hosts")])
        return cls(display, Path(path).resolve(), raw, root)

    def position(self, path: tuple, at_key: bool = False) -> tuple[int, int]:
        """1-based line/col of the value at `path`; of its key when at_key or a collection."""
        parent, node = None, self.root
        for step in path:
            parent = node
            try:
                node = node[step]
            except (KeyError, IndexError, TypeError):
                node = None
                break
        if not path:
            return 1, 1
        last = path[-1]
        try:
            if isinstance(parent, dict):
                if at_key or isinstance(node, (dict, list)):
                    line, col = parent.lc.key(last)
                else:
                    line, col = parent.lc.value(last)
            elif isinstance(parent, list):
                line, col = parent.lc.item(last)
            else:
                return self.position(path[:-1], at_key=True)
        except (KeyError, IndexError, AttributeError, TypeError):
            return self.position(path[:-1], at_key=True)
        return line + 1, col + 1

    def written(self, path: tuple) -> Any:
        """The value at `path` as the file writes it (no defaults filled); None when absent."""
        node = self.root
        for step in path:
            try:
                node = node[step]
            except (KeyError, IndexError, TypeError):
                return None
        return node

    def issue(self, path: tuple, message: str, hint: str | None = None,
              at_key: bool = False) -> ConfigIssue:
        line, col = self.position(path, at_key)
        return ConfigIssue(self.display, line, col, render_path(path), message, hint)


def yaml_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (bool, ScalarBoolean)):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, list):
        return "list"
    return type(value).__name__
