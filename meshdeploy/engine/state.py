"""The state file: which hosts meshdeploy manages for a cluster, and how to reach them.

`<stem>.state.json` lives beside the cluster file and its lock file (`<stem>.lock.json`). The
lock file pins what every host builds, so it is versioned with the cluster file; the state is
what this control machine last put where, so a host that leaves the file is still known (and
destroyed, as Terraform destroys a resource that left its configuration). Beside the file,
because both describe the one cluster that file describes: whoever holds the file finds them,
two checkouts of one cluster file keep apart, and nothing is hidden under a home folder. The
state holds no secret (addresses, SSH settings, names), so committing it is safe, but not needed:
`meshdeploy state rebuild FILE` makes it again from the hosts (docs/runbooks/destroy.md).

JSON with a format_version, written atomically (temporary file, fsync, os.replace, fsync of the
folder); updated after every apply, also a failed one (what was attempted is recorded: a host
is forgotten only once its destroy ran).

The state is checked as strictly as the cluster file (its hosts against the file's own host
schema), and trusted less: a host that left the file is reached only with settings the file
itself uses (docs/security.md, "The state file"). Whoever can write the state must not make
meshdeploy run a command on this machine: no `connection: local`, no ssh_config (its
ProxyCommand runs here) that no host of the file names, no host-key check turned off.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from meshdeploy.config.document import Document
from meshdeploy.config.model import SSH, Cluster, Host, system_layout
from meshdeploy.config.schema import error_issues, load_schema, schema_validator
from meshdeploy.core.files import write_atomic
from meshdeploy.core.plan import utc_now
from meshdeploy.errors import ConfigError, ConfigIssue, PlanError

FORMAT_VERSION = 1
SUFFIX = ".state.json"
MANAGED, RETIRED = "managed", "retired"


def state_path(cluster_path: Path) -> Path:
    return Path(cluster_path).with_name(Path(cluster_path).stem + SUFFIX)


@dataclass
class HostRecord:
    """One host: how to reach it, and what the cluster file had meshdeploy run there.

    status "managed": the host is in the file, or left it and is destroyed at the next apply;
    "retired": it left and was destroyed, but its builds, models and caches were kept (only a
    `--purge` run visits it again).
    """
    name: str
    address: str
    ssh: dict  # model.SSH's fields
    backend: str = "cpu"
    status: str = MANAGED
    units: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    firewall: bool = True
    tunnel: str | None = None  # the WireGuard interface, when the host is in a tunnel mesh
    updated_at: str = ""
    # "local": the machine meshdeploy runs on (absent in files written before local hosts).
    connection: str = "ssh"
    rootless: bool = False  # hosts.NAME.rootless (absent in files written before it)

    def host(self, prefix: str) -> Host:
        """The typed Host meshdeploy connects to (ssh_settings resolves it like a file's host);
        it runs nothing, so every role's destroy hook removes all it finds. `prefix`: the
        cluster's prefix (Cluster.prefix), where a host with root keeps its things."""
        return Host(name=self.name, address=self.address, ssh=SSH(**self.ssh),
                    backend=self.backend, devices=(), rpc_servers=(),
                    connection="local" if self.connection == "local" else "ssh",
                    rootless=self.rootless,
                    layout=None if self.rootless else system_layout(prefix))


@dataclass
class State:
    path: Path
    cluster: str
    hosts: dict[str, HostRecord] = field(default_factory=dict)
    serial: int = 0  # +1 at every write
    updated_at: str = ""
    exists: bool = False
    # The last apply: {"result": "complete" | "failed" | "interrupted", "at": ..., "steps":
    # [{"host", "step", "status", "detail"}, ...]}: what ran, also when it did not finish.
    last_apply: dict | None = None

    def same_access(self, cluster: Cluster, limit=None) -> None:
        """Refuse a host the file now makes rootless that meshdeploy set up with root, or the
        reverse: its services, builds and caches live where the other kind never looks (system
        units against the user's own), so the old ones would keep running and hold the ports."""
        flipped = [(h, self.hosts[h.name]) for h in cluster.hosts
                   if h.name in self.hosts and self.hosts[h.name].status == MANAGED
                   and self.hosts[h.name].rootless != h.rootless
                   and (not limit or h.name in limit)]
        if not flipped:
            return
        names = ", ".join(h.name for h, _ in flipped)
        was = "with root" if not flipped[0][1].rootless else "rootless"
        raise PlanError(
            f"{names}: the cluster file says rootless: {str(flipped[0][0].rootless).lower()}, "
            f"but meshdeploy set {'them' if len(flipped) > 1 else 'it'} up {was} "
            f"({self.path.name}); what runs there would be left running beside the new setup",
            hint=f"put rootless back as it was, run `meshdeploy destroy --limit {names} FILE`, "
                 "then change it and apply")

    def departed(self, cluster: Cluster, purge: bool = False) -> list[Host]:
        """Hosts recorded but no longer in the file: destroyed at the next apply. Retired hosts
        only when purging (their kept bytes are all that is left)."""
        names = {h.name for h in cluster.hosts}
        return [r.host(cluster.prefix) for r in self.hosts.values() if r.name not in names
                and (r.status == MANAGED or purge)]

    def to_dict(self) -> dict:
        extra = {"last_apply": self.last_apply} if self.last_apply is not None else {}
        return {"format_version": FORMAT_VERSION, "cluster": self.cluster, "serial": self.serial,
                "updated_at": self.updated_at, **extra,
                "hosts": {n: {k: v for k, v in vars(r).items() if k != "name"}
                          for n, r in sorted(self.hosts.items())}}


def record_for(cluster: Cluster, host: Host) -> HostRecord:
    """What the file has meshdeploy put on `host`."""
    units = [r.unit_name for r in host.rpc_servers]
    units += [s.unit_name for s in cluster.servers if s.host == host.name]
    models = sorted({s.model for s in cluster.servers if s.host == host.name})
    tunnel = cluster.network.tunnel_interface if cluster.tunnel_peers(host) else None
    ssh = {k: getattr(host.ssh, k) for k in ("user", "port", "key", "config", "sudo", "host_key")}
    return HostRecord(name=host.name, address=host.address, ssh=ssh, backend=host.backend,
                      units=units, models=models, firewall=cluster.network.firewall,
                      tunnel=tunnel, updated_at=utc_now(), connection=host.connection,
                      rootless=host.rootless)


_HINT = ("move the file away and run `meshdeploy state rebuild FILE` to make it again "
         "from the hosts")


def load(cluster: Cluster) -> State:
    """The cluster's state; an empty one when there is none yet. A file that is not a state
    of this format is one PlanError naming it."""
    path = state_path(cluster.path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return State(path=path, cluster=cluster.name)
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the state file: {exc.strerror}",
                        hint=_HINT) from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise PlanError(f"{path}: not a meshdeploy state file (not JSON)", hint=_HINT) from None
    if not isinstance(data, dict) or "format_version" not in data:
        raise PlanError(f"{path}: not a meshdeploy state file (no format_version)", hint=_HINT)
    if data["format_version"] != FORMAT_VERSION:
        raise PlanError(f"{path}: state format {data['format_version']!r} is not supported "
                        f"(this meshdeploy reads format {FORMAT_VERSION})",
                        hint="use the meshdeploy that wrote it, or " + _HINT)
    try:
        hosts = {name: _record(name, r) for name, r in data.get("hosts", {}).items()}
        state = State(path=path, cluster=str(data["cluster"]), hosts=hosts,
                      serial=int(data.get("serial", 0)), updated_at=str(data.get("updated_at", "")),
                      exists=True, last_apply=_last_apply(data.get("last_apply")))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise PlanError(f"{path}: damaged state file ({exc.__class__.__name__}: {exc})",
                        hint=_HINT) from None
    if state.cluster != cluster.name:
        raise PlanError(f"{path}: the state is of cluster {state.cluster!r}, the file names "
                        f"{cluster.name!r}",
                        hint="a renamed cluster: rename `cluster` back, or " + _HINT)
    issues = _untrusted(_document(path, raw), data, state, cluster)
    if issues:
        raise ConfigError(issues)
    return state


def _last_apply(raw) -> dict | None:
    if raw is not None and not (isinstance(raw, dict) and isinstance(raw.get("steps", []), list)):
        raise TypeError("last_apply is not an object with a list of steps")
    return raw


def _record(name: str, raw: dict) -> HostRecord:
    if not isinstance(raw, dict):
        raise TypeError(f"hosts.{name} is not an object")
    known = set(HostRecord.__dataclass_fields__) - {"name"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise KeyError(f"hosts.{name}.{unknown[0]}")
    record = HostRecord(name=name, **raw)
    if not isinstance(record.ssh, dict) or not isinstance(record.address, str):
        raise TypeError(f"hosts.{name}: ssh must be an object, address a string")
    SSH(**record.ssh)  # the fields a Host needs, no others
    if record.status not in (MANAGED, RETIRED):
        raise ValueError(f"hosts.{name}.status {record.status!r}")
    if record.connection not in ("ssh", "local"):
        raise ValueError(f"hosts.{name}.connection {record.connection!r}")
    return record


# -- what a state file is trusted with ---------------------------------------------------------

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


@lru_cache(maxsize=1)
def _validator():
    """The state's `hosts` checked with the cluster file's own schema for what a host record
    shares with a file's host (names, address, connection, backend, ssh port, sudo, host key),
    by the same strict validator; what only the state holds beside it."""
    schema = load_schema()
    host = schema["$defs"]["host"]["properties"]
    ssh = host["ssh"]["properties"]
    name = schema["properties"]["hosts"]["propertyNames"]
    # How the state writes an unset user, key or config (error_issues reads one type a branch).
    optional = {"anyOf": [{"type": "null"}, {"type": "string"}]}
    ssh_record = {"type": "object", "additionalProperties": False,
                  "required": ["user", "port", "key", "config", "sudo"],
                  "properties": {"user": optional, "port": ssh["port"], "key": optional,
                                 "config": optional, "sudo": ssh["sudo"],
                                 "host_key": {"enum": [None] + [v for v in
                                                                ssh["host_key"]["enum"] if v]}}}
    # A network interface's name as the kernel takes it (IFNAMSIZ: 15 characters), of the
    # characters wg-quick accepts.
    interface = {"type": "string", "pattern": "^[A-Za-z0-9_=+.-]{1,15}$"}
    record = {"type": "object", "additionalProperties": False, "required": ["address", "ssh"],
              "properties": {
                  "address": host["address"], "connection": host["connection"],
                  "backend": host["backend"], "ssh": ssh_record,
                  "rootless": host["rootless"],
                  "status": {"enum": [MANAGED, RETIRED]},
                  "units": {"type": "array", "items": {
                      "type": "string", "pattern": "^meshdeploy-(rpc|server)-[A-Za-z0-9_.-]+$"}},
                  "models": {"type": "array", "items": {"type": "string", **name}},
                  "firewall": {"type": "boolean"},
                  "tunnel": {"anyOf": [{"type": "null"}, interface]},
                  "updated_at": {"type": "string"}}}
    return type(schema_validator())({"type": "object", "properties": {"hosts": {
        "type": "object", "propertyNames": name, "additionalProperties": record}}})


def _document(path: Path, raw: bytes):
    """The state as a config Document, for file:line:col in its errors (valid JSON is YAML;
    already read as JSON, so it holds no alias or tag). Without positions when ruamel balks."""
    from ruamel.yaml import YAML

    try:
        root = YAML(typ="rt").load(raw.decode("utf-8"))
    except Exception:  # ruamel raises many classes; positions are a nicety here
        root = None
    return Document(str(path), path, raw, root if isinstance(root, dict) else {})


def _untrusted(doc, data: dict, state: State, cluster: Cluster) -> list[ConfigIssue]:
    """What the state may not say: anything the cluster file's schema refuses, and for a host
    that left the file, a way to reach it that the file itself does not use."""
    issues = [i for e in _validator().iter_errors(data) for i in error_issues(doc, e)]
    for record in state.hosts.values():
        where = ("hosts", record.name, "ssh")
        for key in ("user", "key", "config"):
            value = record.ssh.get(key)
            if isinstance(value, str) and _CONTROL.search(value):
                issues.append(doc.issue(where + (key,), "contains a control character",
                                        "no meshdeploy writes one: " + _HINT))
            elif key != "user" and isinstance(value, str) and not value.startswith("/"):
                issues.append(doc.issue(where + (key,), f"'{value}' is not an absolute path",
                                        "the state records resolved paths: " + _HINT))
    if issues:
        return issues
    in_file = {h.name for h in cluster.hosts}
    for record in state.hosts.values():
        if record.name not in in_file:
            issues += _departed_issues(doc, record, cluster)
    return issues


def _departed_issues(doc, record: HostRecord, cluster: Cluster) -> list[ConfigIssue]:
    name, path = record.name, ("hosts", record.name)
    left = f"{name} left the cluster file, and only the state file says to reach it"

    def fix(setting: str) -> str:
        return (f"if {name} must be destroyed that way, add it back to the cluster file with "
                f"{setting}, run `meshdeploy destroy FILE --limit {name}`, then remove it "
                f"again; otherwise delete hosts.{name} from the state file")

    issues = []
    if record.connection == "local":
        issues.append(doc.issue(path + ("connection",), f"{left} with connection: local "
                                "(its destroy would run on this machine, through sudo)",
                                fix("connection: local")))
    config = record.ssh.get("config")
    if config is not None and config not in {h.ssh.config for h in cluster.hosts}:
        issues.append(doc.issue(path + ("ssh", "config"), f"{left} through the ssh_config "
                                f"{config}, which no host of the cluster file uses (an "
                                "ssh_config's ProxyCommand runs on this machine)",
                                fix(f"ssh.config: {config}")))
    # `no` skips the check; `accept-new` pins whatever key the (state's) address offers first.
    for weaker, what in (("no", "without checking its host key"),
                         ("accept-new", "accepting a host key it has never seen")):
        if record.ssh.get("host_key") == weaker and \
                not any(h.ssh.host_key == weaker for h in cluster.hosts):
            issues.append(doc.issue(path + ("ssh", "host_key"), f"{left} {what} (host_key: "
                                    f"{weaker}), which no host of the cluster file does",
                                    fix(f"ssh.host_key: {weaker}")))
    return issues


def save(state: State) -> None:
    """Write the state atomically: a reader sees the old file or the new one, never half."""
    state.serial += 1
    state.updated_at = utc_now()
    write_atomic(state.path, json.dumps(state.to_dict(), indent=2, sort_keys=True) + "\n", 0o644)
    state.exists = True


def after_apply(state: State, cluster: Cluster, hosts, destroyed: dict[str, bool],
                ok: bool, last: dict | None = None) -> None:
    """Record an apply: the file's hosts it covered, and the departed hosts it destroyed
    (name -> purged). A failed apply still records the file's hosts (what was attempted may
    be there now); a departed host stays until its destroy has run. `last`: how the apply
    ended and the steps that ran ({"result": ..., "steps": [...]})."""
    if last is not None:
        state.last_apply = {**last, "at": utc_now()}
    for host in hosts:
        state.hosts[host.name] = record_for(cluster, host)
    if ok:
        for name, purged in destroyed.items():
            if purged:
                state.hosts.pop(name, None)
            elif name in state.hosts:
                state.hosts[name].status = RETIRED
                state.hosts[name].units = []
                state.hosts[name].updated_at = utc_now()
    save(state)
