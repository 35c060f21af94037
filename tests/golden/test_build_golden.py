"""Golden build scripts and service units for every example inventory.

CUDA, Metal, Vulkan and ROCm cannot be built here (no GPU, no macOS): these goldens pin the
exact cmake invocation and the unit (systemd) or LaunchDaemon (macOS) each host would get.
MESHDEPLOY_UPDATE_GOLDEN=1 rewrites them; review a diff as a change of what hosts run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import golden
from support.accounts import load_inventory
from support.steps import decided
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.sources import HfFile, HfResolved
from meshdeploy.core.context import HostContext
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.services import operations as services
from meshdeploy.roles.services import orchestrator

ROOT = Path(__file__).resolve().parents[2]
INVENTORIES = sorted((ROOT / "inventories").glob("*.yaml")) + [
    Path(__file__).resolve().parents[1] / "data" / "vulkan-rocm.yaml"]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "builds"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
TERMUX_BIN = "/data/data/com.termux/files/usr/bin"
FLAGS = ["-m", "--model", "--host", "--port", "--rpc", "-ngl", "-ts", "-c", "-lm",
         "--api-key-file"]


def contexts(cluster):
    resolved = run_values(commit=COMMIT, build_number=11312, models={})
    for name, model in cluster.models.items():
        files = getattr(model.source, "files", ())
        if files:
            hub = resolved.value("models", "models")
            hub[name] = HfResolved(model.source.repo, "f" * 40, tuple(
                HfFile(f, 1, "a" * 64, f"https://hf.example/{f}") for f in files))
    for host in cluster.hosts:
        # An inventory's rootless hosts are phones under Termux (tests/support/accounts.py).
        key = llama_cpp.build_key(cluster, host, COMMIT, termux=host.rootless)
        kernel = "Darwin" if host.backend == "metal" else "Linux"
        facts = {"toolchain.Platform": {"kernel": kernel, "tools": [], "termux": host.rootless},
                 "llama_cpp.Builds": {"current": None, "builds": {key: {
                     "commit": COMMIT, "rpc_binary": "ggml-rpc-server", "flags": FLAGS}}},
                 "services.Units": {}}
        if host.rootless:
            facts["services.RunitTools"] = {"sh": f"{TERMUX_BIN}/sh",
                                            "svlogd": f"{TERMUX_BIN}/svlogd"}
        yield HostContext(cluster, host, facts, resolved)


def render(inventory: Path) -> str:
    cluster = load_inventory(inventory)
    out = [f"# {inventory.name}: llama.cpp {COMMIT[:12]}"]
    for ctx in contexts(cluster):
        host = ctx.host
        if not llama_cpp.targets(cluster, host):
            continue
        key = llama_cpp.build_key(cluster, host, COMMIT, termux=host.rootless)
        decided(ctx, build_key=key)
        out.append(f"\n## {host.name} ({host.backend}) build {key}")
        out.append(llama_cpp.build_script(ctx, key))
        for rpc in host.rpc_servers:
            step = services.rpc_server(ctx, rpc.port)
            out.append(f"\n## {host.name} {step.change.address}")
            # The unit file (a runit service folder: its run and log/run files): a heredoc.
            out += [c for c in step.commands if "<<'" in c]
        for server in ctx.servers():
            step = orchestrator.llama_server(ctx, server.name)
            out.append(f"\n## {host.name} {step.change.address}")
            out += [c for c in step.commands if "cat >" in c]
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("inventory", INVENTORIES, ids=lambda p: p.stem)
def test_build_and_units_golden(inventory):
    golden.check(GOLDEN / f"{inventory.stem}.txt", render(inventory))


def test_backend_flags_reach_cmake():
    expected = {"cuda": "-DGGML_CUDA=ON", "metal": "-DGGML_METAL=ON",
                "vulkan": "-DGGML_VULKAN=ON", "rocm": "-DGGML_HIP=ON"}
    seen = set()
    for inventory in INVENTORIES:
        cluster = load_inventory(inventory)
        for ctx in contexts(cluster):
            flag = expected.get(ctx.host.backend)
            if flag and llama_cpp.targets(cluster, ctx.host):
                script = llama_cpp.build_script(ctx, llama_cpp.build_key(cluster, ctx.host, COMMIT))
                assert flag in script and "-DGGML_RPC=ON" in script
                seen.add(ctx.host.backend)
    assert seen == set(expected)


def test_macos_hosts_get_launchd_plists_without_sudo_brew():
    cluster = load_cluster(ROOT / "inventories" / "one-mac-mtl0-cpu.yaml")
    ctx = next(c for c in contexts(cluster) if c.host.backend == "metal")
    decided(ctx, build_key=llama_cpp.build_key(cluster, ctx.host, COMMIT))
    step = services.rpc_server(ctx, ctx.host.rpc_servers[0].port)
    assert "/Library/LaunchDaemons/com.meshdeploy.rpc-" in step.commands[0]
    assert "<key>KeepAlive</key>" in step.commands[0]
    assert any("launchctl bootstrap system" in c for c in step.commands)
    assert not any("systemctl" in c for c in step.commands)
