"""Checks on a schema-valid cluster file that JSON Schema cannot express.

Each one exists because the cluster would otherwise fail later, on a host, with a worse message:
two rpc-servers fighting over one device crash (seed split-guide), an unreachable --rpc entry
aborts llama-server at start, an rpc-server serves one client at a time.
"""

from __future__ import annotations

import ipaddress
import re

from meshdeploy.deploy.config import (
    Document,
    host_devices,
    render_path,
    resolve_bind,
    rpc_refs,
)
from meshdeploy.deploy.errors import ConfigIssue
from meshdeploy.deploy.model import CPU_DEVICE, is_loopback, is_private, parse_rpc_ref
from meshdeploy.deploy.schema_errors import suggest

# ggml-rpc.h: llama-server connects to at most this many rpc-servers.
MAX_RPC_SERVERS = 16

ABBREVIATED_COMMIT = re.compile(r"[0-9a-f]{7,39}")
DOTTED_NUMBERS = re.compile(r"[0-9.]+")


def check(doc: Document, data: dict) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    for checker in (check_ref, check_models, check_hosts, check_ports, check_servers):
        issues += checker(doc, data)
    issues.sort(key=lambda i: (i.line, i.col))
    return issues


def check_ref(doc: Document, data: dict) -> list[ConfigIssue]:
    ref = data["llama_cpp"]["ref"]
    if ABBREVIATED_COMMIT.fullmatch(ref):
        return [doc.issue(("llama_cpp", "ref"),
                          f"'{ref}' looks like an abbreviated commit",
                          "write the full 40-hex commit (git rev-parse), or a tag: a short "
                          "hash cannot be fetched reliably and may become ambiguous")]
    return []


def check_models(doc: Document, data: dict) -> list[ConfigIssue]:
    issues = []
    for name, model in data["models"].items():
        hf = model.get("huggingface")
        if hf is None:
            continue
        path = ("models", name, "huggingface")
        if bool(hf["file"]) == bool(hf["files"]):
            both = "both file and files" if hf["file"] else "neither file nor files"
            issues.append(doc.issue(path, f"has {both}",
                                    "give file for one GGUF, or files for the parts of a "
                                    "split GGUF", at_key=True))
        elif hf["files"] and hf["sha256"]:
            issues.append(doc.issue(path + ("sha256",), "sha256 applies to a single file",
                                    "remove it for split models: each part is checked "
                                    "against the hub's LFS hash"))
    return issues


def rpc_device_set(host: dict, device: str) -> set[str]:
    """Devices an rpc-server claims: "" means every device (or the CPU when there is none)."""
    if device:
        return {device}
    return set(host_devices(host)) or {CPU_DEVICE}


def check_hosts(doc: Document, data: dict) -> list[ConfigIssue]:
    issues = []
    net = data["network"]
    for name, host in data["hosts"].items():
        hpath = ("hosts", name)
        address = host["address"]
        if DOTTED_NUMBERS.fullmatch(address):
            try:
                ipaddress.IPv4Address(address)
            except ValueError:
                issues.append(doc.issue(hpath + ("address",),
                                        f"'{address}' is not a valid IPv4 address"))
        devices = host_devices(host)
        claimed: list[tuple[set[str], int]] = []
        for i, rpc in enumerate(host["rpc_servers"]):
            rpath = hpath + ("rpc_servers", i)
            device = rpc["device"]
            if device and device != CPU_DEVICE and device not in devices:
                known = ", ".join(devices + (CPU_DEVICE,))
                issues.append(doc.issue(
                    rpath + ("device",),
                    f"'{device}' is not a device of host {name} ({host['backend']}: {known})",
                    suggest(device, list(devices) + [CPU_DEVICE], "devices") +
                    f" (list the host's devices under hosts.{name}.devices)"))
            mine = rpc_device_set(host, device)
            for other, j in claimed:
                if mine & other:
                    shared = ", ".join(sorted(mine & other))
                    issues.append(doc.issue(
                        rpath + ("device",),
                        f"shares device {shared} with hosts.{name}.rpc_servers[{j}]",
                        "give each rpc-server on one host its own device (-d): two with "
                        "the default both claim every device and crash"))
                    break
            claimed.append((mine, i))
            bind = resolve_bind(host, rpc, net["rpc_bind"])
            if bind is None:
                issues.append(doc.issue(
                    rpath, f"needs an explicit bind: address '{address}' is a DNS name and "
                           "rpc-server -H takes IPv4 literals only",
                    "set bind to the host's IPv4 address on the cluster network", at_key=True))
            elif bind == "0.0.0.0" or not is_private(bind):
                if not net["allow_public"]:
                    where = rpath + ("bind",) if rpc["bind"] else rpath
                    issues.append(doc.issue(
                        where, f"binds {bind}, which is not a private or loopback address",
                        "rpc-server is unauthenticated and unencrypted: bind a private "
                        "address, or set network.allow_public: true to accept the risk",
                        at_key=not rpc["bind"]))
    return issues


def check_ports(doc: Document, data: dict) -> list[ConfigIssue]:
    """One listener per (host, port), whether rpc-server or llama-server."""
    issues = []
    owners: dict[tuple[str, int], str] = {}

    def claim(host: str, port: int, path: tuple) -> None:
        owner = owners.setdefault((host, port), render_path(path[:-1]))
        if owner != render_path(path[:-1]):
            issues.append(doc.issue(path, f"port {port} on host {host} is already used by "
                                          f"{owner}", "pick a free port"))

    for name, host in data["hosts"].items():
        for i, rpc in enumerate(host["rpc_servers"]):
            claim(name, rpc["port"], ("hosts", name, "rpc_servers", i, "port"))
    for name, server in data["servers"].items():
        if server["host"] in data["hosts"]:
            claim(server["host"], server["port"], ("servers", name, "port"))
    return issues


def count_devices(data: dict, refs: tuple[str, ...], host_name: str) -> int:
    total = 0
    for ref in refs:
        rname, port = parse_rpc_ref(ref)
        rhost = data["hosts"][rname]
        rpc = next(r for r in rhost["rpc_servers"] if r["port"] == port)
        total += 1 if rpc["device"] else max(len(host_devices(rhost)), 1)
    return total + len(host_devices(data["hosts"][host_name]))


def check_servers(doc: Document, data: dict) -> list[ConfigIssue]:
    issues = []
    hosts = data["hosts"]
    served: dict[str, str] = {}
    used_by: dict[str, str] = {}
    for name, server in data["servers"].items():
        spath = ("servers", name)
        health = server["health"]
        if health["retries"] * health["interval"] < 1:
            issues.append(doc.issue(spath + ("health",),
                                    f"waits only {health['retries'] * health['interval']:g} s "
                                    "for /health", "allow at least 1 s (retries x interval); "
                                                   "large models take minutes", at_key=True))
        if server["model"] not in data["models"]:
            issues.append(doc.issue(spath + ("model",), f"unknown model '{server['model']}'",
                                    suggest(server["model"], list(data["models"]), "models")))
        elif server["model"] in served:
            issues.append(doc.issue(spath + ("model",),
                                    f"model '{server['model']}' is already served by "
                                    f"servers.{served[server['model']]}",
                                    "serve each model from one orchestrator"))
        else:
            served[server["model"]] = name
        if server["host"] not in hosts:
            issues.append(doc.issue(spath + ("host",), f"unknown host '{server['host']}'",
                                    suggest(server["host"], list(hosts), "hosts")))
            continue
        refs = rpc_refs(data, server) or ()
        bad_ref = False
        if len(refs) > MAX_RPC_SERVERS:
            issues.append(doc.issue(
                spath + ("rpc",), f"uses {len(refs)} rpc-servers; llama.cpp accepts at most "
                f"{MAX_RPC_SERVERS} (GGML_RPC_MAX_SERVERS)",
                "list at most 16 in servers.<name>.rpc, or put several devices behind one "
                "rpc-server", at_key=not server["rpc"]))
        for i, ref in enumerate(refs):
            where = spath + ("rpc", i) if server["rpc"] else spath + ("rpc",)
            problem = rpc_ref_problem(data, ref, server["host"])
            if problem:
                issues.append(doc.issue(where, *problem))
                bad_ref = True
                continue
            if ref in used_by:
                issues.append(doc.issue(
                    where, f"rpc-server {ref} is already used by servers.{used_by[ref]}",
                    "an rpc-server serves one client at a time: give each server its own "
                    "rpc-servers with an explicit rpc list", at_key=not server["rpc"]))
            used_by.setdefault(ref, name)
        split = server["tensor_split"]
        if split != "auto" and not bad_ref:
            tpath = spath + ("tensor_split",)
            wanted = count_devices(data, refs, server["host"])
            if wanted == 0:
                issues.append(doc.issue(
                    tpath, "is set, but the server has no devices to split across",
                    "remove tensor_split, or give the server rpc-servers or a host with "
                    "accelerators", at_key=True))
            elif len(split) != wanted:
                issues.append(doc.issue(
                    tpath, f"has {len(split)} values for {wanted} devices",
                    "one value per device: each rpc-server's devices in --rpc order, then "
                    f"the local devices of host {server['host']}", at_key=True))
            elif not any(split):
                issues.append(doc.issue(tpath, "all values are 0",
                                        "give at least one device a share", at_key=True))
    return issues


def rpc_ref_problem(data: dict, ref: str, from_host: str) -> tuple[str, str] | None:
    name, port = parse_rpc_ref(ref)
    hosts = data["hosts"]
    if name not in hosts:
        return f"unknown host '{name}' in '{ref}'", suggest(name, list(hosts), "hosts")
    rpcs = hosts[name]["rpc_servers"]
    rpc = next((r for r in rpcs if r["port"] == port), None)
    if rpc is None:
        ports = ", ".join(str(r["port"]) for r in rpcs) or "none"
        return (f"host {name} has no rpc-server on port {port}",
                f"rpc-server ports on {name}: {ports}")
    bind = resolve_bind(hosts[name], rpc, data["network"]["rpc_bind"])
    if bind is not None and is_loopback(bind) and name != from_host:
        return (f"rpc-server {ref} listens on {bind}, unreachable from host {from_host}",
                "bind it to an address other hosts can reach, or run the server on "
                f"host {name}")
    return None
