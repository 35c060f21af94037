"""Values into systemd unit files and launchd plists, escaped by each format's own rules.

Every role that writes a unit or a plist renders it here (the services' rpc-server and
llama-server, the network's boot unit and WireGuard LaunchDaemon): a template is filled only
with values these functions made.

systemd (systemd.service "Command lines", systemd.unit "Specifiers" and "Quoting"):
- ExecStart= words are split on whitespace, unquoted with C-style escapes ("\\\\", "\\""), then
  `%` specifiers are resolved, then `$VAR`/`${VAR}` are expanded at start: a literal `%` is
  written `%%` and a literal `$` is written `$$`; a lone `;` would separate commands and a leading
  `-@:+!` on the first word changes how it runs.
- Environment= assignments are unquoted the same way and resolve specifiers (no `$` expansion).
- Description=, LoadCredential= paths, CacheDirectory= take the rest of the line: specifiers only.
- No value can hold a newline: it would end the setting and start another one (an extra
  ExecStartPre=+... line runs as root). Control characters are refused, never emitted.
A launchd plist is XML written by plistlib, which escapes `<`, `&` and `]]>`; XML cannot carry
most control characters (and normalises CR), so those are refused too.
"""

from __future__ import annotations

import ipaddress
import plistlib
import re
from pathlib import Path
from string import Template

from meshdeploy.errors import PlanError


class SystemdExpr(str):
    """An argv item that is meant as a systemd expression (e.g. "${CREDENTIALS_DIRECTORY}/x"):
    written as is, never escaped. Only the code writes these; values never become one."""


_PLAIN = re.compile(r"[A-Za-z0-9_@%$+=:,./-]+")
# C0, DEL, C1 and the Unicode line separators: a line reader may split on any of them.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# systemd.unit: "valid unit names consist of ASCII letters, digits, ':', '-', '_', '.' and '\'";
# meshdeploy's own are plainer still, and never a path.
_UNIT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]*")
_HINT = "remove control characters (newlines, tabs) from the value in the cluster file"


def render(template: Path, **values: str | int) -> str:
    """A unit template (string.Template, `$name`) filled with values this module escaped."""
    return Template(template.read_text()).substitute(values)


def checked(value, setting: str) -> str:
    """The value as text, or PlanError naming the setting when a unit cannot carry it."""
    text = str(value)
    found = _CONTROL.search(text)
    if found:
        raise PlanError(f"{setting}: {text!r} contains the control character "
                        f"{found.group()!r}; a unit file or plist cannot carry it", hint=_HINT)
    return text


def unit_name(name: str, setting: str) -> str:
    if not _UNIT_NAME.fullmatch(name) or len(name) > 200:
        raise PlanError(f"{setting}: {name!r} does not make a valid service name",
                        hint="use letters, digits, '-', '_' and '.' in names")
    return name


def ordered_after(unit: str, setting: str) -> str:
    """After= and Wants= lines: start once `unit` (a service, e.g. "wg-quick@mdwg0") has
    started, and pull it in; its name comes from the cluster file, so it is checked first."""
    name = unit_name(unit, setting) + ".service"
    return f"After={name}\nWants={name}\n"


def _double_quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_arg(value, setting: str) -> str:
    """One ExecStart= word that systemd turns back into exactly `value`."""
    if isinstance(value, SystemdExpr):
        return _double_quoted(checked(value, setting))
    text = checked(value, setting)
    escaped = text.replace("%", "%%").replace("$", "$$")
    if _PLAIN.fullmatch(text):
        return escaped
    return _double_quoted(escaped)


def exec_script(text: str, setting: str) -> str:
    """One ExecStart= word carrying a fixed multi-line script (the code's own template text,
    for `sh -c`): newlines written as C escapes (\\n), which ExecStart= words unescape; any
    other control character is refused."""
    lines = [checked(line, setting) for line in text.split("\n")]
    escaped = "\n".join(lines).replace("%", "%%").replace("$", "$$")
    return _double_quoted(escaped).replace("\n", "\\n")


def exec_line(argv: list, setting: str) -> str:
    """ExecStart= value; the program must be an absolute path (no `-@:+!` prefixes)."""
    program = checked(argv[0], setting)
    if not program.startswith("/"):
        raise PlanError(f"{setting}: the program {program!r} is not an absolute path",
                        hint="the prefix meshdeploy installs under must be an absolute path")
    return " ".join(exec_arg(a, setting) for a in argv)


def env_line(name: str, value, setting: str) -> str:
    """Environment=NAME=value, quoted when needed; `%` doubled ($ is literal there)."""
    if not _ENV_NAME.fullmatch(name):
        raise PlanError(f"{setting}: {name!r} is not an environment variable name")
    text = f"{name}={checked(value, setting)}".replace("%", "%%")
    return "Environment=" + (text if _PLAIN.fullmatch(text) else _double_quoted(text)) + "\n"


def line_value(value, setting: str) -> str:
    """A value that takes the rest of its line (Description=, LoadCredential= paths): specifiers
    escaped; edge whitespace (stripped by systemd) and a trailing backslash (a line
    continuation) cannot be represented and are refused."""
    text = checked(value, setting)
    if text != text.strip() or text.endswith("\\"):
        raise PlanError(f"{setting}: {text!r} begins or ends with whitespace or a backslash, "
                        "which a unit file line cannot carry", hint=_HINT)
    return text.replace("%", "%%")


def ip_literals(addresses, setting: str) -> str | None:
    """IPAddressAllow= value: IP literals and networks (and `localhost`, a systemd keyword)
    separated by spaces; None when one is a DNS name, which systemd cannot put in the cgroup's
    allow list."""
    out = []
    for address in addresses:
        text = checked(address, setting)
        if text != "localhost":
            try:
                text = str(ipaddress.ip_address(text))
            except ValueError:
                try:
                    text = str(ipaddress.ip_network(text, strict=True))
                except ValueError:
                    return None
        if text not in out:
            out.append(text)
    return " ".join(out)


def comment_value(value, setting: str) -> str:
    """A value inside a comment line: never parsed, but a newline would end the comment."""
    return checked(value, setting)


def plist(doc: dict, setting: str) -> str:
    """plistlib's XML of `doc`; every string checked for what XML cannot carry."""
    def walk(value):
        if isinstance(value, str):
            checked(value, setting)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
    walk(doc)
    return plistlib.dumps(doc, sort_keys=True).decode()
