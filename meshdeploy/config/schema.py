"""JSON Schema validation of a cluster file, and its errors rewritten for people.

jsonschema's messages ("'x' does not match '^(?!-)...'") mean nothing to a user; each error
becomes a ConfigIssue at file:line:col that says what the field accepts, with a hint.
"""

from __future__ import annotations

import difflib
import json
import math
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import jsonschema.validators
from jsonschema.exceptions import best_match, relevance
from ruamel.yaml.scalarbool import ScalarBoolean

import meshdeploy.roles
from meshdeploy.config.document import Document, yaml_type
from meshdeploy.config.yaml_doc import printable, render_path
from meshdeploy.errors import ConfigIssue, MeshdeployError


# The sections no role owns yet (schemas/core.schema.json), and the complete schema editors read
# (schemas/cluster.schema.json): generated from the core and every role's schema.json by
# write_complete() (scripts/schema), and checked to be current by the unit tests.
CORE = "core.schema.json"
COMPLETE = "cluster.schema.json"


@lru_cache(maxsize=1)
def load_schema() -> dict:
    """The cluster file's schema: schemas/core.schema.json with each role's own section merged in
    as `properties.<role>` (see role_fragments); a section whose fragment says
    `"x-meshdeploy-required": true` joins the top level's `required`."""
    text = resources.files("meshdeploy.schemas").joinpath(CORE).read_text()
    schema = json.loads(text)
    for name, (where, fragment) in role_fragments().items():
        if name in schema["properties"]:
            raise MeshdeployError(f"{where} declares the section '{name}', which the cluster "
                                  "file already has",
                                  "a role's schema.json describes a new top-level key named "
                                  "after its folder (schema.<section>.json: after <section>); "
                                  "rename the role or the section")
        schema["properties"][name] = fragment
        if fragment.get(REQUIRED):
            schema["required"].append(name)
    return schema


def layout_field(schema: dict, name: str) -> tuple[str, str]:
    """(section, key) of the role field marked `"x-meshdeploy-layout": name` (the folder under
    which hosts with root keep meshdeploy's things is `prefix`): the core reads the value
    without naming the role that declares it."""
    found = [(section, key) for section, fragment in schema["properties"].items()
             for key, field in (fragment.get("properties") or {}).items()
             if field.get(LAYOUT) == name]
    if len(found) != 1:
        raise MeshdeployError(f"{len(found)} sections declare the layout field '{name}'",
                              f"exactly one role's schema.json marks a field {LAYOUT}: {name}")
    return found[0]


@lru_cache(maxsize=1)
def role_fragments() -> dict[str, tuple[str, dict]]:
    """Section name -> (its file, the JSON Schema of the section) for every
    meshdeploy/roles/<role>/schema.json (the section named after the role) and
    meshdeploy/roles/<role>/schema.<section>.json (a section of another name the role owns, as
    the models role owns `huggingface:`).

    The fragments are package data, read as files from the folders of the meshdeploy.roles
    package (whose __init__ holds no code); no role module is imported, so the cluster file's
    schema stays below core. The import of the package is one of the layers contract's two
    named exceptions (pyproject.toml).
    """
    out: dict[str, tuple[str, dict]] = {}
    read: set[Path] = set()
    for folder in meshdeploy.roles.__path__:
        for path in sorted(Path(folder).glob("*/schema*.json")):
            if path.resolve() in read:  # one folder on the package path twice
                continue
            read.add(path.resolve())
            where = f"roles/{path.parent.name}/{path.name}"
            section = path.parent.name if path.name == "schema.json" else \
                path.name[len("schema."):-len(".json")]
            if not section or "." in section:
                raise MeshdeployError(f"{where}: a role's sections are schema.json and "
                                      "schema.<section>.json", "rename the file")
            try:
                fragment = json.loads(path.read_text())
                jsonschema.Draft202012Validator.check_schema(fragment)
            except (ValueError, jsonschema.SchemaError) as exc:
                raise MeshdeployError(f"{where} is not a JSON Schema: {exc}".splitlines()[0],
                                      "fix the role's schema.json") from None
            if _refers(fragment):
                # Merged under properties.<role>, a "#/..." reference would point into the
                # cluster file's schema, not the fragment.
                raise MeshdeployError(f"{where} uses $ref or $defs: a role's section is "
                                      "written out in full", "fix the role's schema.json")
            if section in out:
                raise MeshdeployError(f"{where} declares the section '{section}', which "
                                      f"{out[section][0]} declares too",
                                      "one role owns a section: rename one of them")
            out[section] = (where, fragment)
    return out


def complete_text() -> str:
    """schemas/cluster.schema.json as it must read: the whole schema, every role's section in."""
    return json.dumps(load_schema(), indent=2, ensure_ascii=False) + "\n"


def write_complete() -> Path:
    """Write schemas/cluster.schema.json from the core and the roles' sections; its path."""
    path = Path(str(resources.files("meshdeploy.schemas").joinpath(COMPLETE)))
    path.write_text(complete_text())
    return path


def _refers(node) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or "$defs" in node or any(_refers(v) for v in node.values())
    return isinstance(node, list) and any(_refers(v) for v in node)


def role_sections() -> tuple[str, ...]:
    """The top-level keys the roles' schema files add, in name order."""
    return tuple(sorted(role_fragments()))


# A role's schema.json says what a value failing its `pattern` is, and how to write one, beside
# the pattern: annotations of its own, which validators and editors leave alone.
MEANING = "x-meshdeploy-meaning"
HINT = "x-meshdeploy-hint"
# A role's section the cluster file must have (schema.json's top level), and a field of it the
# core reads for the hosts' layout (layout_field).
REQUIRED = "x-meshdeploy-required"
LAYOUT = "x-meshdeploy-layout"

# Why a value failed a `pattern` of the core sections, by field: its path with names as `*` and
# list items as `[]` (see field_key), or its bare name where that is unambiguous.
PATH_MEANING = "is not an absolute, normalized path (no '//', '.' or '..' parts, no trailing '/')"
PATTERN_MEANING = {
    "cluster": "is not a valid name (letters, digits, '_', '.', '-'; starts with a letter or digit)",
    "models.*.huggingface.revision": "is not a git branch, tag or commit",
    "store": PATH_MEANING,
    "path": PATH_MEANING,
    "api_key_file": PATH_MEANING + " on the host",
    "endpoint": "is not an http:// or https:// URL (no spaces, quotes or backslashes)",
    "address": "is not an IPv4 address or DNS name",
    "devices": "is not a device name like CUDA0, MTL0 or Vulkan0",
    "device": "is not a device name like CUDA1, MTL0 or CPU",
    "models.*.huggingface.repo": "is not a Hugging Face repository id (owner/name)",
    "file": "is not a file in the repository (a relative path without '..' parts, not starting "
            "with '-' or '/')",
    "files": "is not a file in the repository (a relative path without '..' parts, not starting "
             "with '-' or '/')",
    "sha256": "is not 64 lowercase hex digits",
    "model": "is not an Ollama model name like qwen3-coder:30b (no '..' or '//')",
    "rpc": "is not host:port (a host name from hosts, then the rpc-server's port)",
    "hosts.*.rpc_servers[].bind": "is not an IPv4 address",
    "servers.*.bind": "is not an IPv4 address or host name",
}

PATTERN_HINT = {
    "rpc": "write the host's name from hosts, e.g. node2:50052",
    "sha256": "sha256sum prints it; leave \"\" to trust the hub's hash",
    "file": "e.g. gemma-3-270m-q4_k_m.gguf, or a folder/file.gguf path in the repository",
    "files": "e.g. Q4_K_M/model-00001-of-00002.gguf",
    "servers.*.bind": "e.g. 127.0.0.1, or the host's cluster address",
}

# What an either/or field accepts, for values that match neither branch.
ALTERNATIVES = {
    "tensor_split": "'auto' or a list of numbers, one per device",
    "rpc": "'none' or a list of host:port entries",
    "bind": "an IPv4 address such as 10.0.0.5, or \"\" for the network.rpc_bind rule",
}

# Names under these keys are the user's (hosts.gpu-01); field_key writes them as `*`.
NAMED = ("hosts", "models", "servers")


def field_key(path: tuple) -> str:
    """`servers.main.rpc[0]` -> `servers.*.rpc[]`: the field, whatever the names and indexes."""
    generic = tuple("*" if i == 1 and path[0] in NAMED else "[]" if isinstance(step, int)
                    else step for i, step in enumerate(path))
    return "".join(s if s == "[]" else f".{s}" for s in generic).lstrip(".")


def field_lookup(table: dict, path: tuple) -> Any:
    """The entry for the field; a bare name matches only outside the roles' own sections."""
    if path and path[0] in role_fragments():
        return table.get(field_key(path))
    name = next((s for s in reversed(path) if isinstance(s, str)), "")
    return table.get(field_key(path), table.get(name))


# JSON Schema's own types are too lenient for a file whose values reach command lines: 50052.0
# is an "integer" and NaN a "number" there. ruamel's anchored booleans are ints, not bools.
def is_boolean(_checker: Any, value: Any) -> bool:
    return isinstance(value, (bool, ScalarBoolean))


def is_integer(_checker: Any, value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, (bool, ScalarBoolean))


def is_number(checker: Any, value: Any) -> bool:
    return is_integer(checker, value) or (isinstance(value, float) and math.isfinite(value))


def unique_strings(validator: Any, unique: bool, instance: Any, schema: dict):
    """uniqueItems in linear time: every such list here holds strings or integers, and any
    other item already fails `items` (jsonschema's own check is quadratic on unhashable items)."""
    if not unique or not validator.is_type(instance, "array"):
        return
    if first_repeat(instance) is not None:
        yield jsonschema.ValidationError(f"{instance!r} has non-unique elements")


def first_repeat(values: list) -> str | int | None:
    seen: set = set()
    for value in values:
        # type(): True is not the integer 1 here (items refuses booleans in integer lists).
        if type(value) in (str, int):
            if value in seen:
                return value
            seen.add(value)
    return None


@lru_cache(maxsize=1)
def schema_validator() -> Any:
    strict = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"boolean": is_boolean, "integer": is_integer, "number": is_number})
    cls = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                       validators={"uniqueItems": unique_strings},
                                       type_checker=strict)
    return cls(load_schema())


def schema_issues(doc: Document) -> list[ConfigIssue]:
    errors = list(schema_validator().iter_errors(doc.root))
    if not errors:
        return []
    first = max(errors, key=relevance)  # best_match would descend into oneOf branches
    errors.sort(key=lambda e: (e is not first, doc.position(tuple(e.absolute_path))))
    issues: list[ConfigIssue] = []
    seen: set[ConfigIssue] = set()
    for error in errors:
        for issue in error_issues(doc, error):
            if issue not in seen:
                seen.add(issue)
                issues.append(issue)
    return issues


def error_issues(doc: Document, error: jsonschema.ValidationError) -> list[ConfigIssue]:
    path = tuple(error.absolute_path)
    name = next((s for s in reversed(path) if isinstance(s, str)), "")
    value = error.instance
    kind = error.validator
    schema = error.schema if isinstance(error.schema, dict) else {}

    if "propertyNames" in error.schema_path:
        # jsonschema reports the offending name itself as the instance, at its mapping's path.
        return [doc.issue(path + (value,), f"{show(value)} is not a valid name",
                          "use letters, digits, '_', '.', '-' (no ':' or spaces)", at_key=True)]
    if kind in ("oneOf", "anyOf"):
        # Errors from the branch whose type matched (a bad list item, too many values) say
        # more than "is not 'auto'"; type/const failures only say the branch did not apply.
        specific = [e for e in error.context or ()
                    if len(e.absolute_path) > len(error.absolute_path)
                    or e.validator not in ("type", "const", "enum")]
        if specific:
            return error_issues(doc, best_match(specific, key=relevance))
        wanted = ALTERNATIVES.get(name, "one of the documented forms")
        return [doc.issue(path, f"{show(value)} is not {wanted}")]
    if kind == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        unknown = [k for k in value if k not in allowed]
        return [doc.issue(path + (key,), f"unknown key '{printable(str(key))}'",
                          suggest(str(key), allowed, "allowed keys"), at_key=True)
                for key in unknown]
    if kind == "required":
        missing = [k for k in error.validator_value if k not in value]
        where = render_path(path) or "the top level"
        return [doc.issue(path, f"missing required key '{key}'",
                          f"add '{key}:' under {where}", at_key=True) for key in missing]
    if kind == "enum":
        options = [show_option(o) for o in error.validator_value]
        hint = suggest(str(value), [str(o) for o in error.validator_value if o])
        if name == "load_mode":
            hint += " ('none' loads without mmap, the old --no-mmap)"
        return [doc.issue(path, f"{show(value)} is not one of {', '.join(options)}", hint)]
    if kind == "type":
        wanted = error.validator_value
        hint = None
        if isinstance(value, float) and not math.isfinite(value):
            return [doc.issue(path, f"{show(value)} is not a finite number",
                              "write a number such as 1 or 0.5")]
        if wanted == "integer" and isinstance(value, float) and value.is_integer():
            hint = f"write it without the fraction: {int(value)}"
        elif wanted == "string" and value is not None and not isinstance(value, (dict, list)):
            hint = f"quote it: '{show(value)}'"
        label = {"object": "mapping", "array": "list"}.get(wanted, wanted)
        article = "an" if str(label)[0] in "aeiou" else "a"
        # A mapping or a list is named by its kind alone ("got a list"), a scalar with its
        # value too ("got string 'x'").
        got = show(value) if isinstance(value, (dict, list)) else f"{yaml_type(value)} {show(value)}"
        return [doc.issue(path, f"expected {article} {label}, got {got}", hint)]
    if kind == "pattern":
        # A role's schema.json says it beside the pattern (MEANING, HINT); the core's, below.
        meaning = error.schema.get(MEANING) or field_lookup(PATTERN_MEANING, path) or \
            f"does not match {error.validator_value}"
        hint = error.schema.get(HINT) or field_lookup(PATTERN_HINT, path)
        return [doc.issue(path, f"{show(value)} {meaning}", hint)]
    if kind in ("minimum", "exclusiveMinimum", "maximum"):
        bound = error.validator_value
        relation = {"minimum": f"at least {bound}", "exclusiveMinimum": f"more than {bound}",
                    "maximum": f"at most {bound}"}[kind]
        return [doc.issue(path, f"{show(value)} is out of range: must be {relation}")]
    if kind == "minProperties":
        if name == "hosts":
            return [doc.issue(path, "needs at least one host", "add a host with an address")]
        return [doc.issue(path, "needs exactly one source: huggingface, ollama or path")]
    if kind == "maxProperties":
        return [doc.issue(path, f"has several sources ({', '.join(value)}); keep exactly one")]
    if kind == "maxItems":
        return [doc.issue(path, f"has {len(value)} values; llama.cpp accepts at most "
                                f"{error.validator_value}")]
    if kind == "minItems":
        return [doc.issue(path, "needs at least one value")]
    if kind == "uniqueItems":
        dup = first_repeat(value)
        return [doc.issue(path, f"lists {show(dup)} more than once")]
    if kind == "const":
        return [doc.issue(path, f"{show(value)} is not {show(error.validator_value)}")]
    return [doc.issue(path, error.message)]


def show(value: Any) -> str:
    if isinstance(value, str):
        return f"'{printable(str(value))}'"
    if isinstance(value, (bool, ScalarBoolean)):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return f"a {yaml_type(value)}"
    if value is None:
        return "null"
    return printable(str(value))


def show_option(option: Any) -> str:
    return '""' if option == "" else str(option)


def suggest(word: str, options: list[str], label: str = "allowed") -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    return f"{label}: {', '.join(options)}"
