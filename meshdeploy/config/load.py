"""Read a cluster file: YAML with positions, JSON Schema, then the typed model.

Every problem becomes a ConfigIssue pointing at file:line:col, so a user fixes the file without
guessing. The schema checks the plain data; the typed model (meshdeploy.config.model) is built
from it. core.loading, which every command calls, completes it with each role's part and runs
the checks the schema cannot express (meshdeploy.config.checks and each role's) on that model,
pointing back into the file through the Document.
"""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import os
from pathlib import Path
from typing import Any

from ruamel.yaml.scalarbool import ScalarBoolean

from meshdeploy.config.document import Document
from meshdeploy.config.model import (
    DEFAULT_DEVICES,
    SSH,
    Cluster,
    Failover,
    Health,
    Host,
    RpcServer,
    Server,
    rpc_ref,
    system_layout,
)
from meshdeploy.config.sources import HfSource, Model, OllamaSource, PathSource
from meshdeploy.config.schema import (
    layout_field,
    load_schema,
    role_sections,
    schema_issues,
)
from meshdeploy.errors import ConfigError


def read_cluster(path: str | Path) -> tuple[Document, Cluster]:
    """Read a cluster file, validate it against the schema and build the typed model: the
    document (for file:line:col) and the cluster. Raises ConfigError at once when the schema
    refuses the file. What the roles' sections decide and the semantic checks (this layer's,
    config.checks, and the roles') are core.loading's, which is what commands call."""
    doc = Document.read(path)
    issues = schema_issues(doc)
    if issues:
        raise ConfigError(issues)
    return doc, build_cluster(doc, fill_defaults(doc.root, load_schema()))




# -- defaults and the typed model ------------------------------------------------------------

def fill_defaults(instance: Any, schema: dict, root: dict | None = None) -> Any:
    """Plain data (no ruamel types) with every schema default filled in."""
    root = root or schema
    if "$ref" in schema:
        target = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            target = target[part]
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    if isinstance(instance, dict):
        out = {}
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key in instance:
                out[key] = fill_defaults(instance[key], sub, root)
            elif "default" in sub and schema.get("maxProperties") != 1:
                # A model's sources are alternatives: defaulting the absent ones would
                # give every model several sources.
                out[key] = fill_defaults(copy.deepcopy(sub["default"]), sub, root)
        extra = schema.get("additionalProperties")
        for key, value in instance.items():
            if key not in props:
                out[str(key)] = fill_defaults(value, extra, root) if isinstance(extra, dict) \
                    else value
        return out
    if isinstance(instance, list):
        items = schema.get("items", {})
        return [fill_defaults(v, items, root) for v in instance]
    if isinstance(instance, (bool, ScalarBoolean)):
        return bool(instance)
    if isinstance(instance, int):
        return int(instance)
    if isinstance(instance, float):
        return float(instance)
    if isinstance(instance, str):
        return str(instance)
    return instance


def unset(value: str) -> str | None:
    return value if value != "" else None


def control_path(value: str, base: Path) -> str | None:
    """A path on the control machine: ~ expanded, relative to the cluster file's folder."""
    if value == "":
        return None
    path = Path(os.path.expanduser(value))
    if not path.is_absolute():
        path = base / path
    return str(path)


def default_bind(host: dict, rpc: dict) -> str | None:
    """-H value for an rpc-server on the hosts' own network: the file's bind, else the host's
    address, None when that is not IPv4 (the network role's rules may decide otherwise:
    cluster_file.complete)."""
    if rpc["bind"]:
        return rpc["bind"]
    try:
        return str(ipaddress.IPv4Address(host["address"]))
    except ValueError:
        return None


def host_devices(host: dict) -> tuple[str, ...]:
    """The file's devices, else the backend's default; a vulkan host that names its visible
    devices has one Vulkan<i> for each of them."""
    if host["devices"]:
        return tuple(host["devices"])
    if host["backend"] == "vulkan" and host["vulkan_visible_devices"]:
        return tuple(f"Vulkan{i}" for i in range(len(host["vulkan_visible_devices"])))
    return DEFAULT_DEVICES[host["backend"]]


def rpc_refs(data: dict, server: dict) -> tuple[str, ...] | None:
    """The file's rpc setting resolved to "host:port" names; None for `none`."""
    if server["rpc"] == "none":
        return None
    if server["rpc"]:
        return tuple(server["rpc"])
    return tuple(rpc_ref(name, rpc["port"]) for name, host in data["hosts"].items()
                 for rpc in host["rpc_servers"])


def _written(doc: Document, server: str, key: str) -> bool:
    """Whether the file itself sets servers.SERVER.KEY (not the schema's default)."""
    return key in ((doc.root.get("servers") or {}).get(server) or {})


def placement(doc: Document, name: str, s: dict) -> str:
    """servers.NAME.placement as written; unset: auto beside tensor_split auto, else memory
    (the file's split is kept)."""
    if _written(doc, name, "placement"):
        return s["placement"]
    return "auto" if s["tensor_split"] == "auto" else "memory"


def build_cluster(doc: Document, data: dict) -> Cluster:
    """The typed model of schema-valid `data`; config_checks.check decides whether it is usable
    (until then an rpc-server on a DNS-named host without a bind has bind None)."""
    base = doc.path.parent
    section, key = layout_field(load_schema(), "prefix")
    prefix = data[section][key]
    hosts = []
    for name, h in data["hosts"].items():
        rpcs = tuple(
            RpcServer(port=r["port"], bind=default_bind(h, r), device=unset(r["device"]),
                      threads=r["threads"], cache=r["cache"], fetch=r["fetch"],
                      file_bind=r["bind"])
            for r in h["rpc_servers"])
        s = h["ssh"]
        ssh = SSH(user=unset(s["user"]), port=s["port"], key=control_path(s["key"], base),
                  config=control_path(s["config"], base), sudo=s["sudo"],
                  host_key=unset(s["host_key"]))
        hosts.append(Host(name=name, address=h["address"], ssh=ssh, backend=h["backend"],
                          devices=host_devices(h), rpc_servers=rpcs,
                          connection=h["connection"], rootless=h["rootless"],
                          unprotected=h["unprotected"],
                          keep_free=int(h["keep_free_gb"] * 1e9),
                          vulkan_visible=tuple(h["vulkan_visible_devices"]),
                          layout=None if h["rootless"] else system_layout(prefix)))
    models = {name: Model(name, model_source(m)) for name, m in data["models"].items()}
    servers = tuple(
        Server(name=name, host=s["host"], model=s["model"], port=s["port"], bind=s["bind"],
               ctx_size=s["ctx_size"], n_gpu_layers=s["n_gpu_layers"],
               tensor_split=s["tensor_split"] if s["tensor_split"] == "auto"
               else tuple(float(v) for v in s["tensor_split"]),
               placement=placement(doc, name, s),
               placement_set=_written(doc, name, "placement"), rpc=rpc_refs(data, s),
               load_mode=unset(s["load_mode"]),
               api_key_file=unset(s["api_key_file"]), allow=tuple(s["allow"]),
               extra_args=tuple(s["extra_args"]),
               health=Health(s["health"]["retries"], float(s["health"]["interval"])),
               allow_unauthenticated=s["allow_unauthenticated"],
               failover=Failover(tolerate=s["failover"]["tolerate"],
                                 seed=s["failover"]["seed"]))
        for name, s in data["servers"].items())
    return Cluster(
        name=data["cluster"],
        path=doc.path,
        prefix=prefix,
        hosts=tuple(hosts),
        models=models,
        servers=servers,
        source_hash=hashlib.sha256(doc.raw).hexdigest(),
        sections=role_data(data),
    )


def role_data(data: dict) -> dict[str, Any]:
    """The roles' own sections (their schema.json) as plain data, defaults filled; an absent
    section reads as its defaults. Each role makes its typed settings from its part."""
    schema = load_schema()
    return {name: data[name] if name in data else
            fill_defaults({}, schema["properties"][name], schema)
            for name in role_sections()}


def model_source(m: dict) -> HfSource | OllamaSource | PathSource:
    if "huggingface" in m:
        h = m["huggingface"]
        files = (h["file"],) if h["file"] else tuple(h["files"])
        return HfSource(repo=h["repo"], files=files, revision=h["revision"],
                        sha256=unset(h["sha256"]), endpoint=unset(h["endpoint"]))
    if "ollama" in m:
        o = m["ollama"]
        model, _, tag = o["model"].partition(":")
        return OllamaSource(model=model, tag=tag or "latest", store=unset(o["store"]))
    return PathSource(path=m["path"])
