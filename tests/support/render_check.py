"""Render every remote command, unit and plist of a cluster, and check nothing escapes its quoting.

Shared by tests/unit/test_render_properties.py (hypothesis, hostile values put straight into the
model) and benchmarks/fuzz_render.py (the soak: cluster files that validate accepts). For every
rendered shell command: bash parses it (bash -n); every quoted word core.shell produced while
rendering is read back by bash (printf, in a scratch folder: the only thing ever executed) and
must equal its value; and the sentinel "PWNED" that hostile values carry occurs nowhere outside
those words and heredoc bodies. Units are read back by tests/support/systemd_parse.py, plists by
plistlib. Renderers may refuse with PlanError; anything else propagates to the caller.

The checks return findings (one string each, naming the offending command or unit) instead of
asserting, so the soak can count them and the property test can assert there are none.
"""

from __future__ import annotations

import dataclasses
import plistlib
import re
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from support.steps import decided

from meshdeploy.commands.status import host_script
from meshdeploy.config.sources import HfFile, HfResolved, HfSource
from meshdeploy.core import paths, shell
from meshdeploy.core.context import HostContext
from meshdeploy.engine.planner import probe_command
from meshdeploy.errors import PlanError
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.llama_cpp.facts import ls_remote
from meshdeploy.roles.models import operations as models
from meshdeploy.roles.rpc_cache import operations as rpc_cache
from meshdeploy.roles.services import argv as argvs
from meshdeploy.roles.services import operations as services
from meshdeploy.roles.services import orchestrator
from meshdeploy.roles.services import unit_files
from meshdeploy.roles.toolchain import operations as toolchain
from meshdeploy.roles.llama_cpp import settings
from support import systemd_parse as sd
from support.resolved import run_values

COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
SENTINEL = "PWNED"
UNIT_KEYS = {"Description", "After", "Wants", "StartLimitIntervalSec", "Type", "ExecStart",
             "Environment", "LoadCredential", "DynamicUser", "Restart", "RestartSec",
             "NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp",
             "ProtectKernelTunables", "ProtectKernelModules", "ProtectControlGroups",
             "RestrictAddressFamilies", "LockPersonality", "WantedBy",
             "CapabilityBoundingSet", "AmbientCapabilities", "SystemCallArchitectures",
             "SystemCallFilter", "SystemCallErrorNumber", "RestrictNamespaces",
             "RestrictRealtime", "RestrictSUIDSGID", "ProtectClock", "ProtectKernelLogs",
             "ProtectHostname", "ProtectProc", "RemoveIPC", "UMask", "PrivateDevices",
             "DevicePolicy", "DeviceAllow", "MemoryDenyWriteExecute", "IPAddressDeny",
             "IPAddressAllow", "SupplementaryGroups", "CacheDirectory"}
HEREDOC = re.compile(r"<<'(MESHDEPLOY_\w+)'\n.*?\n\1(?:\n|$)", re.S)


@dataclass
class Extras:
    """Values the renderers get from the run, not the cluster file (download URL, seed paths).

    None = derived from the cluster; the property test passes hostile ones.
    """

    url_path: str = "f"
    seed_tool: str | None = None
    seed_cache: str | None = None
    seed_model: str | None = None


@dataclass
class Rendered:
    commands: list[str] = field(default_factory=list)
    units: list = field(default_factory=list)  # (server, unit text or None)
    plists: list = field(default_factory=list)  # (argv, plist text or None)
    words: list = field(default_factory=list)  # (value, quoted) from every shell.quote call


@contextmanager
def recorded_quotes():
    """Every (value, quoted word) core.shell.quote returns while the block runs."""
    words: list[tuple[object, str]] = []
    real = shell.quote

    def recording(value, what="a value"):
        quoted = real(value, what)
        words.append((value, quoted))
        return quoted

    shell.quote = recording
    try:
        yield words
    finally:
        shell.quote = real


def contexts(cluster, extras: Extras):
    """One HostContext per host: facts of a host that needs everything (a fresh source, no
    units), the first host's model files of the right size but unverified (the
    verify-then-download path); hosts with a Metal backend report Darwin (launchd)."""
    resolved_models = {}
    for name, model in cluster.models.items():
        if isinstance(model.source, HfSource):
            resolved_models[name] = HfResolved(model.source.repo, "f" * 40, tuple(
                HfFile(f, 10, "a" * 64, "http://h/" + extras.url_path)
                for f in model.source.files))
    resolved = run_values(commit=COMMIT, build_number=11312, models=resolved_models, hf_token="t")
    for i, host in enumerate(cluster.hosts):
        key = llama_cpp.build_key(cluster, host, COMMIT)
        darwin = host.backend == "metal"
        facts = {"toolchain.Platform": {"kernel": "Darwin" if darwin else "Linux",
                                        "tools": ["brew"] if darwin else ["apt-get"]},
                 "toolchain.AptProxy": None, "toolchain.DebPackages": {},
                 "llama_cpp.Source": {"head": "f" * 40, "url": "other", "has_commit": False},
                 "llama_cpp.Builds": {"current": None, "builds": {key: {
                     "commit": COMMIT, "rpc_binary": "ggml-rpc-server",
                     "flags": sorted(argvs.UPSTREAM_FLAGS)}}},
                 "services.Units": {}, "models.DiskFree": None}
        if i == 0:
            for name, res in resolved_models.items():
                for f in res.files:
                    facts[f"models.ModelFile[{name}/{f.name}]"] = {
                        "size": 10, "mtime": 1, "verified": None, "partial": None, "link": None}
        yield decided(HostContext(cluster, host, facts, resolved), build_key=key)


def _attempt(fn, *args):
    try:
        return fn(*args)
    except PlanError:
        return None


def render_all(cluster, extras: Extras | None = None) -> Rendered:
    """Every renderer on every host, quoted words recorded; steps refused by PlanError skipped."""
    extras = extras or Extras()
    prefix = cluster.prefix
    out = Rendered()
    with recorded_quotes() as words:
        out.commands.append(ls_remote(settings.of(cluster).repo, settings.of(cluster).ref))
        for i, host in enumerate(cluster.hosts):
            got = _attempt(probe_command, cluster, host, i == 0, "n0nce")
            if got:
                out.commands.append(got[1])
            out.commands.append(_attempt(host_script, cluster, host))
        for ctx in contexts(cluster, extras):
            _render_host(ctx, cluster, extras, prefix, out)
    out.words = words
    out.commands = [c for c in out.commands if c]
    return out


def _render_host(ctx, cluster, extras, prefix, out):
    steps = [_attempt(toolchain.apt_proxy, ctx), _attempt(llama_cpp.source, ctx),
             _attempt(rpc_cache.seed_tool, ctx), _attempt(services.stale_units, ctx)]
    steps += [_attempt(models.gguf, ctx, name) for name in cluster.models]
    out.commands += [_attempt(llama_cpp.build_script, ctx, ctx.build.key),
                     _attempt(llama_cpp.activate_script, ctx, ctx.build.key)]
    for rpc in ctx.host.rpc_servers:
        steps.append(_attempt(services.rpc_server, ctx, rpc.port))
        seed_model = extras.seed_model or next(
            (paths.model_path(cluster, s.model, cluster.host(s.host)) for s in cluster.servers), "/m.gguf")
        out.commands.append(_attempt(
            rpc_cache._seed_script, extras.seed_tool or f"{prefix}/tool",
            extras.seed_cache or f"{prefix}/cache", [("a" * 64, 0, 11 << 20, "0" * 16)],
            [(rpc_cache.SeedModel(seed_model, "a" * 64, ()), [(0, 11 << 20)])],
            [(rpc_cache.SeedModel("", "a" * 64, (), seed_model, ctx.host.name),
              f"http://{ctx.host.address}:29180/models/{seed_model}",
              [(0, 11 << 20, "0" * 16, "b" * 64)])]))
    for server in ctx.servers():
        steps.append(_attempt(orchestrator.llama_server, ctx, server.name))
        out.units.append((server, _attempt(unit_files.server_unit, cluster, ctx.host, server,
                                           "/opt/b", None, "a" * 64)))
        argv = _attempt(argvs.llama_server_argv, "/opt/b/bin/llama-server", cluster, server,
                        "/m.gguf")
        if argv:
            out.plists.append((argv, _attempt(services.launchd_plist, "com.meshdeploy.s", argv,
                                              {"K": extras.url_path}, "/var/log")))
    out.commands += [c for s in steps if s for c in s.commands if isinstance(c, str)]


# -- checks: each returns findings, [] when nothing escaped -----------------------------------

def check_commands(commands, words, scratch: Path) -> list[str]:
    findings = []
    for command in commands:
        syntax = subprocess.run(["bash", "-n", "-c", command], capture_output=True, timeout=20)
        if syntax.returncode != 0:
            why = syntax.stderr.decode(errors="replace").strip()
            findings.append(f"bash -n refuses it ({why}):\n{command}")
        rest = HEREDOC.sub("", command)
        for _, quoted in sorted(words, key=lambda w: -len(w[1])):
            rest = rest.replace(quoted, "")
        if SENTINEL in rest:
            findings.append(f"{SENTINEL} outside a quoted word:\n{command}")
    if words:
        # Read every quoted word back through bash, all in one run, in a scratch folder.
        script = "printf '%s\\0' " + " ".join(q for _, q in words)
        out = subprocess.run(["bash", "-c", script], capture_output=True, cwd=scratch,
                             timeout=20, env={"PATH": "/usr/bin:/bin"})
        got = out.stdout.split(b"\0")[:-1]
        want = [str(value).encode() for value, _ in words]
        if got != want:
            bad = next(((w, q) for (w, q), g in zip(words, got) if str(w).encode() != g),
                       words[min(len(got), len(words) - 1)])
            findings.append(f"a quoted word reads back differently: {bad[0]!r} quoted as "
                            f"{bad[1]}")
    if (scratch / SENTINEL).exists():
        findings.append(f"reading the quoted words back created {scratch / SENTINEL}")
    return findings


def check_units(cluster, units) -> list[str]:
    findings = []
    for server, unit in units:
        if unit is None:
            continue
        try:
            findings += _check_unit(cluster, server, unit)
        except ValueError as exc:
            findings.append(f"unit does not parse back ({exc}):\n{unit}")
    return findings


def _check_unit(cluster, server, unit) -> list[str]:
    lines = sd.settings(unit)
    keys = [k for k, _ in lines]
    if not set(keys) <= UNIT_KEYS or keys.count("ExecStart") != 1:
        return [f"unexpected settings {sorted(set(keys) - UNIT_KEYS)} or ExecStart count "
                f"{keys.count('ExecStart')}:\n{unit}"]
    (exec_start,) = [value for k, value in lines if k == "ExecStart"]
    key_file = server.api_key_file
    if key_file:
        server = dataclasses.replace(server, api_key_file="${CREDENTIALS_DIRECTORY}/api-key")
    want = argvs.llama_server_argv("/opt/b/bin/llama-server", cluster, server,
                                   paths.model_path(cluster, server.model, cluster.host(server.host)), None)
    got = sd.exec_argv(exec_start)
    findings = []
    if got != want:
        findings.append(f"ExecStart reads back as {got!r}, not {want!r}:\n{unit}")
        return findings
    expansions = [i for i, a in enumerate(got) if isinstance(a, sd.Expansion)]
    if expansions != ([got.index("--api-key-file") + 1] if key_file else []):
        findings.append(f"ExecStart expands something at {expansions}:\n{unit}")
    if key_file and ("LoadCredential", "api-key:" + key_file.replace("%", "%%")) not in lines:
        findings.append(f"LoadCredential does not carry {key_file!r}:\n{unit}")
    env = [sd.env_assignment(value) for k, value in lines if k == "Environment"]
    if env != [("MESHDEPLOY_MODEL_SHA256", "a" * 64)]:
        findings.append(f"Environment reads back as {env!r}:\n{unit}")
    return findings


def check_plists(plists) -> list[str]:
    findings = []
    for argv, text in plists:
        if text is None:
            continue
        try:
            back = plistlib.loads(text.encode())["ProgramArguments"]
        except Exception as exc:  # noqa: BLE001 - a plist that does not load is the finding
            findings.append(f"plist does not load ({exc}):\n{text}")
            continue
        if back != argv:
            findings.append(f"plist ProgramArguments read back as {back!r}:\n{text}")
    return findings


def check(cluster, rendered: Rendered, scratch: Path) -> list[str]:
    """Every finding for one rendered cluster; [] when nothing escaped its quoting."""
    return (check_commands(rendered.commands, rendered.words, scratch)
            + check_units(cluster, rendered.units) + check_plists(rendered.plists))
