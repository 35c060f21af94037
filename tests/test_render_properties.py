"""Property tests: hostile values in every field a renderer reads never escape their quoting.

The values are put straight into the model objects (dataclasses.replace), not through validate:
this layer must be safe for any string the model can hold. For every rendered remote command:
bash parses it (bash -n); every quoted word deploy.shell produced while rendering is read back
by bash (printf, in a temp dir: the only thing ever executed) and must equal its value; and the
sentinel "PWNED" that hostile values carry occurs nowhere outside those words and heredoc bodies.
Units are read back by tests/systemd_parse.py; plists by plistlib. Only PlanError may be raised.
"""

from __future__ import annotations

import dataclasses
import plistlib
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshdeploy.deploy import shell
from meshdeploy.deploy.config import load_cluster
from meshdeploy.deploy.context import HostContext, Resolved
from meshdeploy.deploy.engine import probe_command
from meshdeploy.deploy.errors import PlanError
from meshdeploy.deploy.model import HfSource
from meshdeploy.deploy.status import host_script
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.llama_cpp.facts import ls_remote
from meshdeploy.roles.models import operations as models
from meshdeploy.roles.models.hf import HfFile, HfResolved
from meshdeploy.roles.rpc_cache import operations as rpc_cache
from meshdeploy.roles.services import argv as argvs
from meshdeploy.roles.services import operations as services
from meshdeploy.roles.toolchain import operations as toolchain
from tests import systemd_parse as sd

ROOT = Path(__file__).resolve().parent.parent
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
PARTS = ["a", "b", " ", "'", '"', "$(touch PWNED)", "`touch PWNED`", "; touch PWNED",
         "&& touch PWNED", "\n", "%h", "%%", "$HOME", "${X}", "$$", "-", "--x=", "\\", "é",
         "日", "]]>", "<", "&", "|", "*", "?", "~", "\t", "\r", "MESHDEPLOY_EOF", "#", "=", ":",
         "/", "..", "\x7f", "\u2028"]
VALUE = st.one_of(st.lists(st.sampled_from(PARTS), max_size=6).map("".join),
                  st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
                          max_size=8))
FIELDS = st.fixed_dictionaries({
    k: VALUE for k in ("bind", "extra", "repo", "ref", "prefix", "file", "api_key", "device",
                       "ccache", "proxy", "rpc_bind", "path")})


@pytest.fixture(scope="module")
def lab():
    return load_cluster(ROOT / "inventories" / "lab.yaml")


def hostile_cluster(lab, v):
    llama = dataclasses.replace(
        lab.llama_cpp, repo=v["repo"], ref=v["ref"], prefix="/" + v["prefix"],
        build=dataclasses.replace(lab.llama_cpp.build, ccache_dir="/" + v["ccache"],
                                  cmake_flags=("-DX=" + v["extra"],)))
    node2 = lab.host("node2")
    rpc = dataclasses.replace(node2.rpc_servers[0], bind=v["rpc_bind"], device=v["device"],
                              cache=True)
    hosts = (lab.hosts[0], dataclasses.replace(node2, rpc_servers=(rpc,)), lab.hosts[2])
    server = dataclasses.replace(lab.servers[0], bind=v["bind"], extra_args=(v["extra"], "-x"),
                                 api_key_file="/" + v["api_key"])
    src = lab.models["gemma"].source
    gemma = dataclasses.replace(lab.models["gemma"], source=dataclasses.replace(
        src, files=(v["file"] or "f",)))
    return dataclasses.replace(lab, llama_cpp=llama, hosts=hosts, servers=(server,),
                               models={"gemma": gemma},
                               toolchain=dataclasses.replace(lab.toolchain, apt_proxy=v["proxy"]))


def contexts(cluster, v):
    src = cluster.models["gemma"].source
    assert isinstance(src, HfSource)
    resolved = Resolved(commit=COMMIT, build_number=11312, models={"gemma": HfResolved(
        src.repo, "f" * 40, (HfFile(src.files[0], 10, "a" * 64, "http://h/" + v["path"]),))},
        hf_token="t")
    for host in cluster.hosts:
        key = llama_cpp.build_key(cluster, host, COMMIT)
        facts = {"toolchain.Platform": {"kernel": "Linux", "tools": ["apt-get"]},
                 "toolchain.AptProxy": None, "toolchain.DebPackages": {},
                 "llama_cpp.Source": {"head": "f" * 40, "url": "other", "has_commit": False},
                 "llama_cpp.Builds": {"current": None, "builds": {key: {
                     "commit": COMMIT, "rpc_binary": "ggml-rpc-server",
                     "flags": sorted(argvs.UPSTREAM_FLAGS)}}},
                 "services.Units": {}, "models.DiskFree": None}
        if host.name == "node1":  # the right size, unverified: the verify-then-download path
            facts[f"models.ModelFile[gemma/{src.files[0]}]"] = {
                "size": 10, "mtime": 1, "verified": None, "partial": None, "link": None}
        yield HostContext(cluster, host, facts, resolved, run={"build_key": key})


def render_all(cluster, v) -> tuple[list[str], list[str], list]:
    """(shell commands, unit files, plists+argv) of every renderer; PlanError steps skipped."""
    commands, units, plists = [ls_remote(cluster.llama_cpp.repo, cluster.llama_cpp.ref)], [], []

    def attempt(fn, *args):
        try:
            return fn(*args)
        except PlanError:
            return None

    for i, host in enumerate(cluster.hosts):
        got = attempt(probe_command, cluster, host, COMMIT, i == 0, "n0nce")
        if got:
            commands.append(got[1])
        commands.append(attempt(host_script, cluster, host))
    for ctx in contexts(cluster, v):
        steps = [attempt(toolchain.apt_proxy, ctx), attempt(llama_cpp.source, ctx),
                 attempt(models.gguf, ctx, "gemma"), attempt(rpc_cache.seed_tool, ctx),
                 attempt(services.stale_units, ctx)]
        build = attempt(llama_cpp.build_script, ctx, ctx.run["build_key"])
        commands += [build, attempt(llama_cpp.activate_script, ctx, ctx.run["build_key"])]
        for rpc in ctx.host.rpc_servers:
            steps.append(attempt(services.rpc_server, ctx, rpc.port))
            commands.append(attempt(rpc_cache._seed_script, "/" + v["prefix"] + "/tool",
                                    "/" + v["path"], [("a" * 64, 0, 11 << 20, "0" * 16)],
                                    [(rpc_cache.SeedModel("/" + v["file"], "a" * 64, ()),
                                      [(0, 11 << 20)])]))
        for server in ctx.servers():
            steps.append(attempt(services.llama_server, ctx, server.name))
            units.append((server, attempt(services.server_unit, cluster, ctx.host, server,
                                          "/opt/b", None, "a" * 64)))
            argv = attempt(argvs.llama_server_argv, "/opt/b/bin/llama-server", cluster, server,
                           "/m.gguf")
            if argv:
                plists.append((argv, attempt(services.launchd_plist, "com.meshdeploy.s", argv,
                                             {"K": v["path"]}, "/var/log")))
        commands += [c for s in steps if s for c in s.commands if isinstance(c, str)]
    return [c for c in commands if c], units, plists


HEREDOC = re.compile(r"<<'(MESHDEPLOY_\w+)'\n.*?\n\1(?:\n|$)", re.S)


def check_commands(commands, words, tmp_path):
    for command in commands:
        syntax = subprocess.run(["bash", "-n", "-c", command], capture_output=True, timeout=20)
        assert syntax.returncode == 0, (syntax.stderr, command)
        rest = HEREDOC.sub("", command)
        for _, quoted in sorted(words, key=lambda w: -len(w[1])):
            rest = rest.replace(quoted, "")
        assert "PWNED" not in rest, command
    if words:
        # Read every quoted word back through bash, all in one run, in a scratch folder.
        script = "printf '%s\\0' " + " ".join(q for _, q in words)
        out = subprocess.run(["bash", "-c", script], capture_output=True, cwd=tmp_path,
                             timeout=20, env={"PATH": "/usr/bin:/bin"})
        assert out.stdout.split(b"\0")[:-1] == [str(value).encode() for value, _ in words]
    assert not (tmp_path / "PWNED").exists()


def check_units(cluster, units):
    allowed = {"Description", "After", "Wants", "StartLimitIntervalSec", "Type", "ExecStart",
               "Environment", "LoadCredential", "DynamicUser", "Restart", "RestartSec",
               "NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp",
               "ProtectKernelTunables", "ProtectKernelModules", "ProtectControlGroups",
               "RestrictAddressFamilies", "LockPersonality", "WantedBy",
               "CapabilityBoundingSet", "AmbientCapabilities", "SystemCallArchitectures",
               "SystemCallFilter", "SystemCallErrorNumber", "RestrictNamespaces",
               "RestrictRealtime", "RestrictSUIDSGID", "ProtectClock", "ProtectKernelLogs",
               "ProtectHostname", "ProtectProc", "RemoveIPC", "UMask", "PrivateDevices",
               "DevicePolicy", "DeviceAllow", "MemoryDenyWriteExecute", "IPAddressDeny",
               "IPAddressAllow", "SupplementaryGroups"}
    for server, unit in units:
        if unit is None:
            continue
        lines = sd.settings(unit)
        assert {k for k, _ in lines} <= allowed, unit
        assert [k for k, _ in lines].count("ExecStart") == 1
        (exec_start,) = [value for k, value in lines if k == "ExecStart"]
        want = argvs.llama_server_argv("/opt/b/bin/llama-server", cluster, dataclasses.replace(
            server, api_key_file="${CREDENTIALS_DIRECTORY}/api-key"), models.model_path(
            cluster, server.model), None)
        got = sd.exec_argv(exec_start)
        assert got == want
        key = got.index("--api-key-file") + 1
        assert [i for i, a in enumerate(got) if isinstance(a, sd.Expansion)] == [key]
        assert ("LoadCredential", "api-key:" + server.api_key_file.replace("%", "%%")) in lines
        env = [sd.env_assignment(value) for k, value in lines if k == "Environment"]
        assert env == [("MESHDEPLOY_MODEL_SHA256", "a" * 64)]


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(FIELDS)
def test_hostile_values_never_escape(lab, tmp_path, monkeypatch, v):
    words = []
    real_quote = shell.quote

    def recording(value, what="a value"):
        quoted = real_quote(value, what)
        words.append((value, quoted))
        return quoted

    monkeypatch.setattr(shell, "quote", recording)
    cluster = hostile_cluster(lab, v)
    commands, units, plists = render_all(cluster, v)
    monkeypatch.setattr(shell, "quote", real_quote)
    check_commands(commands, words, tmp_path)
    check_units(cluster, units)
    for argv, text in plists:
        if text is not None:
            assert plistlib.loads(text.encode())["ProgramArguments"] == argv
