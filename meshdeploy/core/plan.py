"""The plan as data: what would change on which host, and why.

Computing a plan and printing it are separate (as in Terraform): the engine builds `Change`
records and typed sections (placement, network, transfers, warnings), `meshdeploy.views.plan`
turns the one structure into text or JSON (docs/plan-json.md), and `save_plan`/`load_plan` carry
it from `plan -out FILE` to `apply FILE`. A saved plan records what it was computed from
(the cluster file's hash and each host's facts fingerprint) so `apply` can refuse a stale one.
"""

from __future__ import annotations

import hashlib
import json
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from meshdeploy.core.files import write_atomic
from meshdeploy.errors import PlanError, StalePlanError

ACTIONS = ("create", "update", "replace", "delete", "no-op")
# 2: typed placement/network/run fields replace `extra` (`transfers` was added within it).
# A saved plan of another version is refused (run plan again): saved plans are short-lived.
FORMAT_VERSION = 2

_REPLAN_HINT = "run `meshdeploy plan` again to make a fresh plan"


@dataclass
class AttrDiff:
    name: str
    before: Any = None  # None = absent
    after: Any = None
    forces_replacement: bool = False
    known_after_apply: bool = False  # value only known after apply (e.g. a rebuild's binary)
    sensitive: bool = False  # rendered as (sensitive value)

    @property
    def unchanged(self) -> bool:
        return self.before == self.after and not self.known_after_apply


@dataclass
class Change:
    host: str
    role: str  # toolchain | llama_cpp | models | services
    resource: str  # e.g. "build", "gguf[gemma]", "rpc_server[50052]"
    action: str  # one of ACTIONS
    diffs: list[AttrDiff] = field(default_factory=list)
    reason: str = ""  # why, e.g. "pin moved b7000 -> b11312"
    unit_diff: str | None = None  # unified diff of a unit file / plist, if any

    def __post_init__(self):
        # A misspelt action would silently vanish from counts and renderings.
        if self.action not in ACTIONS:
            raise ValueError(
                f"{self.host}/{self.role}.{self.resource}: action {self.action!r} "
                f"is not one of {', '.join(ACTIONS)}"
            )

    @property
    def address(self) -> str:
        return f"{self.host}/{self.role}.{self.resource}"


# --- typed sections ------------------------------------------------------------------------
# Numbers stay numbers (bytes, milliseconds); the views decide how to print them.


@dataclass
class PlacementRow:
    """One device of a llama-server, in llama-server's -ts order (RPC devices first)."""

    device: str  # "node2:50052/CPU" (RPC) or "box16/CUDA0" (the orchestrator's own)
    host: str
    port: int | None  # the rpc-server's port; None for the orchestrator's own device
    first_layer: int | None  # None: the split gives this device no layer
    last_layer: int | None
    output: bool  # holds the output layer
    weights_bytes: int
    kv_bytes: int
    needed_bytes: int  # weights + KV + llama.cpp's compute buffer
    seeded_bytes: int | None  # pre-seeded into rpc-server's cache; None: no cache on the device
    wire_bytes: int  # what one model load sends to the device over RPC
    free_bytes: int | None  # usable memory; None: unknown
    free_estimated: bool  # free memory is an estimate (e.g. Metal on a Mac mini)
    headroom_bytes: int | None  # free - needed; None: free memory unknown


@dataclass
class Speed:
    """Tokens per second predicted for a placement (placement.speed), from device speeds
    `meshdeploy bench --sweep` measured at `measured_at`."""

    gen_tps: float  # generation, the split this plan applies
    prompt_tps: float | None  # prompt processing; None: not measured
    memory_gen_tps: float | None  # generation with llama.cpp's split by free memory (None:
    memory_prompt_tps: float | None  # the free memory of a device is not known)
    measured_at: str
    gen_ms_per_gb: list[float] = field(default_factory=list)  # per device, in row order
    rtt_ms: list[float] = field(default_factory=list)  # per device: a measured round trip (0:
    # local, or not measured); empty where the sweep timed none
    alone_gen_tps: float | None = None  # the model measured on the orchestrator alone


@dataclass
class FailoverRow:
    """The placement md-failover starts while some workers are away (placement.failover.Run)."""

    lost: list[str]  # the worker hosts away
    rpc: list[str]  # the rpc-servers llama-server then dials ("host:port")
    placement: str | None  # "node2:50052/CPU: layers 0-17 + output"; None: it cannot serve
    gen_tps: float | None  # predicted generation tokens/s; None: no current measurement
    refusal: str | None = None  # why it cannot serve ("... does not fit ...")


@dataclass
class Placement:
    """Where one llama-server's layers land, as llama.cpp splits them."""

    server: str
    model: str
    ctx_tokens: int  # the KV cache's context
    ctx_fitted_from: int | None  # ctx_size 0 asked for this many; ctx_tokens is -fit's guess
    slots: int
    cache_type_k: str
    cache_type_v: str
    rows: list[PlacementRow] = field(default_factory=list)
    # What chose the split: "memory" (llama.cpp, by free memory), "tensor_split" (the file's),
    # "speed" (placement: auto, from measured device speeds).
    split_by: str = "memory"
    speed: Speed | None = None  # None: no current measurement of these devices, build and model
    # The rpc-servers the full placement leaves off --rpc: they would hold no layer.
    idle: list[str] = field(default_factory=list)
    tolerate: int = 0  # servers.NAME.failover.tolerate where md-failover runs it, else 0
    failover: list[FailoverRow] = field(default_factory=list)
    # "host:port" -> hashed bytes the failover placements add to that rpc-server's cache
    # (servers.NAME.failover.seed); empty where they add none or are not seeded.
    failover_seed_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class RttEndpoint:
    endpoint: str  # "10.200.0.12:50052", as llama-server's --rpc names it
    host: str
    rtt_ms: float  # measured from the orchestrator; 0 for its own rpc-servers
    remote: bool  # another host: each token pays one round trip to it


@dataclass
class Network:
    """Measured RTT orchestrator -> workers and the per-token cost it implies."""

    server: str
    host: str  # the orchestrator
    endpoints: list[RttEndpoint] = field(default_factory=list)
    round_trips: int = 0  # per token: one per remote endpoint
    per_token_ms: float = 0.0  # the sum of their RTTs, on top of compute
    # Endpoints the orchestrator could not reach when it probed (down, or a tunnel not up yet):
    # no RTT, so not in per_token_ms.
    unreachable: list[str] = field(default_factory=list)


@dataclass
class HostAccess:
    """How meshdeploy works on one host: with root or as the login user, under which service
    manager, and what keeps its rpc-server ports to their orchestrators."""

    host: str
    access: str  # "root (sudo)", "root (login)", "rootless (user md)"
    manager: str  # the service manager: systemd, systemd --user, runit, launchd
    protection: str  # "allow-list (nftables)", "none: unprotected", ...


@dataclass
class TransferRow:
    """The model bytes apply brings to one host (the sum of its steps' Transfers)."""

    host: str
    internet_bytes: int  # downloaded from the model's source
    lan_bytes: int  # fetched from another host's copy
    disk_bytes: int  # what they take on the host's disk
    disk_free: int | None  # free under the folder they go to (the least of them); None: unknown


def _count(changes: list[Change]) -> dict:
    n = {a: 0 for a in ACTIONS}
    for c in changes:
        n[c.action] += 1
    # Terraform counts a replace as one add plus one destroy.
    return {
        "add": n["create"] + n["replace"],
        "change": n["update"],
        "destroy": n["delete"] + n["replace"],
    }


@dataclass
class Plan:
    cluster_name: str
    cluster_path: str
    config_hash: str  # sha256 of the cluster file (+ lock file) bytes
    fingerprints: dict[str, str]  # host -> sha256 of its gathered facts
    changes: list[Change]
    warnings: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)  # hosts covered, in cluster order
    created_at: str = ""  # ISO 8601 UTC
    meshdeploy_version: str = ""
    commit: str | None = None  # the llama.cpp commit every host runs after apply
    commit_source: str = ""  # how it was resolved: "lock file", "ls-remote on HOST", ...
    limit: list[str] = field(default_factory=list)  # --limit hosts; apply FILE keeps them
    placement: list[Placement] = field(default_factory=list)
    network: list[Network] = field(default_factory=list)
    transfers: list[TransferRow] = field(default_factory=list)  # hosts that receive model bytes
    # One row per host when the cluster has a rootless host (it is not the usual root/systemd).
    access: list[HostAccess] = field(default_factory=list)
    remote_commands: dict[str, int] = field(default_factory=dict)  # host -> commands to plan
    seconds: float | None = None  # how long planning took
    replace: list[str] = field(default_factory=list)  # -replace addresses; apply FILE keeps them
    target: list[str] = field(default_factory=list)  # -target addresses; apply FILE keeps them
    # What hosts that leave keep without --purge: "node3: models gemma (253.1 MB)".
    kept: list[str] = field(default_factory=list)
    purge: bool = False  # builds, models and caches of departing hosts are removed too
    # The host that is the machine meshdeploy runs on (connection: local), if one is covered.
    local_host: str | None = None

    def counts(self) -> dict:
        return _count(self.changes)

    def host_counts(self) -> list[dict]:
        """One row per host (plan.hosts order, then any host only seen in changes)."""
        rows = []
        for host in self.all_hosts():
            mine = [c for c in self.changes if c.host == host]
            row = {"host": host, **_count(mine)}
            row["unchanged"] = sum(1 for c in mine if c.action == "no-op")
            rows.append(row)
        return rows

    def all_hosts(self) -> list[str]:
        seen = list(self.hosts)
        for c in self.changes:
            if c.host not in seen:
                seen.append(c.host)
        return seen

    def has_changes(self) -> bool:
        return any(c.action != "no-op" for c in self.changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["format_version"] = FORMAT_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return _plan_from_dict(d)


def utc_now() -> str:
    """Timestamp for Plan.created_at."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def hash_files(paths) -> str:
    """sha256 over the bytes of each file in order (missing files count as absent, not empty)."""
    h = hashlib.sha256()
    for p in paths:
        p = Path(p)
        if p.exists():
            data = p.read_bytes()
            # Length-prefixing keeps ("ab", "c") and ("a", "bc") apart.
            h.update(f"{p.name}:{len(data)}:".encode())
            h.update(data)
        else:
            h.update(f"{p.name}:absent:".encode())
    return h.hexdigest()


def fingerprint(facts: Any) -> str:
    """sha256 of a host's gathered facts, independent of dict ordering."""
    blob = json.dumps(facts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


# --- reading a plan back -------------------------------------------------------------------

_ATTR_FIELDS = {
    "name": str,
    "before": object,
    "after": object,
    "forces_replacement": bool,
    "known_after_apply": bool,
    "sensitive": bool,
}
_CHANGE_FIELDS = {
    "host": str,
    "role": str,
    "resource": str,
    "action": str,
    "diffs": list,
    "reason": str,
    "unit_diff": (str, type(None)),
}
_PLAN_FIELDS = {
    "cluster_name": str,
    "cluster_path": str,
    "config_hash": str,
    "fingerprints": dict,
    "changes": list,
    "warnings": list,
    "hosts": list,
    "created_at": str,
    "meshdeploy_version": str,
}
# Typed fields read by _typed, against Plan's own annotations.
_TYPED_PLAN_FIELDS = ("commit", "commit_source", "limit", "placement", "network", "transfers",
                      "access", "remote_commands", "seconds", "replace", "target", "kept",
                      "purge", "local_host")
_REQUIRED_PLAN = ("cluster_name", "cluster_path", "config_hash", "fingerprints", "changes")
_REQUIRED_CHANGE = ("host", "role", "resource", "action")
_REQUIRED_ATTR = ("name",)
_TYPE_NAMES = {str: "a string", bool: "true/false", list: "a list", dict: "an object"}


def _fields(d: Any, spec: dict, required: tuple, where: str, ignore=()) -> dict:
    if not isinstance(d, dict):
        raise PlanError(f"{where}: expected an object, got {type(d).__name__}", hint=_REPLAN_HINT)
    unknown = sorted(set(d) - set(spec) - set(ignore))
    if unknown:
        raise PlanError(f"{where}: unknown key {unknown[0]!r}", hint=_REPLAN_HINT)
    missing = [k for k in required if k not in d]
    if missing:
        raise PlanError(f"{where}: missing key {missing[0]!r}", hint=_REPLAN_HINT)
    out = {}
    for key, typ in spec.items():
        if key not in d:
            continue
        if typ is not object and not isinstance(d[key], typ):
            want = _TYPE_NAMES.get(typ, "a string or null")
            raise PlanError(f"{where}.{key}: expected {want}", hint=_REPLAN_HINT)
        out[key] = d[key]
    return out


def _typed(hint: Any, value: Any, where: str) -> Any:
    """`value` read as `hint` (a dataclass, list[...], dict[str, ...], X | None, or a scalar)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _typed(inner, value, where)
    if is_dataclass(hint):
        names = {f.name for f in fields(hint)}
        required = tuple(f.name for f in fields(hint)
                         if f.default is MISSING and f.default_factory is MISSING)
        raw = _fields(value, dict.fromkeys(names, object), required, where)
        inner = typing.get_type_hints(hint)
        return hint(**{k: _typed(inner[k], v, f"{where}.{k}") for k, v in raw.items()})
    if origin is list:
        if not isinstance(value, list):
            raise PlanError(f"{where}: expected a list", hint=_REPLAN_HINT)
        return [_typed(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise PlanError(f"{where}: expected an object", hint=_REPLAN_HINT)
        return {k: _typed(args[1], v, f"{where}.{k}") for k, v in value.items()}
    # JSON has one number type: an integral float such as 2.0 may come back as 2.
    ok = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}[hint]
    if not isinstance(value, ok) or (hint is not bool and isinstance(value, bool)):
        want = {int: "an integer", float: "a number"}.get(hint) or _TYPE_NAMES[hint]
        raise PlanError(f"{where}: expected {want}", hint=_REPLAN_HINT)
    return float(value) if hint is float else value


def _plan_from_dict(d: Any) -> Plan:
    if not isinstance(d, dict) or "format_version" not in d:
        raise PlanError("not a meshdeploy plan (no format_version)", hint=_REPLAN_HINT)
    version = d["format_version"]
    if version != FORMAT_VERSION:
        raise PlanError(
            f"plan format {version!r} is not supported (this meshdeploy reads format "
            f"{FORMAT_VERSION})",
            hint=_REPLAN_HINT,
        )
    spec = dict(_PLAN_FIELDS, **{k: object for k in _TYPED_PLAN_FIELDS})
    top = _fields(d, spec, _REQUIRED_PLAN, "plan", ignore=("format_version",))
    hints = typing.get_type_hints(Plan)
    for key in _TYPED_PLAN_FIELDS:
        if key in top:
            top[key] = _typed(hints[key], top[key], f"plan.{key}")
    changes = []
    for i, raw in enumerate(top["changes"]):
        where = f"changes[{i}]"
        # "address" is derived; older or hand-made files may carry it.
        c = _fields(raw, _CHANGE_FIELDS, _REQUIRED_CHANGE, where, ignore=("address",))
        if c["action"] not in ACTIONS:
            raise PlanError(
                f"{where}.action: {c['action']!r} is not one of {', '.join(ACTIONS)}",
                hint=_REPLAN_HINT,
            )
        diffs = [
            AttrDiff(**_fields(a, _ATTR_FIELDS, _REQUIRED_ATTR, f"{where}.diffs[{j}]"))
            for j, a in enumerate(c.pop("diffs", []))
        ]
        changes.append(Change(diffs=diffs, **c))
    top["changes"] = changes
    for key in ("warnings", "hosts"):
        if not all(isinstance(x, str) for x in top.get(key, [])):
            raise PlanError(f"plan.{key}: expected a list of strings", hint=_REPLAN_HINT)
    if not all(isinstance(v, str) for v in top["fingerprints"].values()):
        raise PlanError("plan.fingerprints: expected host -> string", hint=_REPLAN_HINT)
    return Plan(**top)


# --- plan files ----------------------------------------------------------------------------


def save_plan(plan: Plan, path) -> None:
    """Write the plan as JSON, atomically, readable by the owner only.

    Mode 0600 because a saved plan keeps sensitive values in clear (apply needs them).
    """
    path = Path(path)
    try:
        text = json.dumps(plan.to_dict(), sort_keys=True, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"plan cannot be saved as JSON: {e}") from e
    write_atomic(path, text, 0o600)


def load_plan(path) -> Plan:
    """Read a plan written by save_plan; any problem is one PlanError naming the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise PlanError(f"{path}: plan file not found", hint=_REPLAN_HINT) from None
    except OSError as e:
        raise PlanError(f"{path}: cannot read plan file: {e.strerror}", hint=_REPLAN_HINT) from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise PlanError(
            f"{path}: not a meshdeploy plan file (not JSON)",
            hint=f"pass a file written by `meshdeploy plan -out FILE`; {_REPLAN_HINT}",
        ) from None
    try:
        return _plan_from_dict(data)
    except PlanError as e:
        raise PlanError(f"{path}: {e}", hint=getattr(e, "hint", None) or _REPLAN_HINT) from None


def check_fresh(plan: Plan, config_hash: str, fingerprints: dict[str, str]) -> None:
    """Refuse a plan whose cluster file or hosts changed since it was made.

    `fingerprints` are the hosts' facts gathered now; only the hosts the plan covers are compared.
    """
    problems = []
    if config_hash != plan.config_hash:
        problems.append(f"{plan.cluster_path} changed since the plan was made")
    drifted = [h for h, fp in plan.fingerprints.items()
               if h in fingerprints and fingerprints[h] != fp]
    missing = [h for h in plan.fingerprints if h not in fingerprints]
    if drifted:
        problems.append(f"{', '.join(drifted)} changed since the plan was made (facts differ)")
    if missing:
        problems.append(f"{', '.join(missing)}: no facts gathered now to compare with the plan")
    if problems:
        raise StalePlanError("; ".join(problems) + ": run plan again", hint=_REPLAN_HINT)


def size_text(n: int | None) -> str:
    """Bytes as a plan says them ("253.1 MB"); "size unknown" for None."""
    if n is None:
        return "size unknown"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
