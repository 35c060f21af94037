"""Golden command lines for every example inventory, plus flag-compatibility rules.

The goldens are reviewed by eye against the seed documents the inventories reproduce; a diff here
means a host would run a different command. MESHDEPLOY_UPDATE_GOLDEN=1 rewrites them.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path

import pytest
from support import golden
from support.accounts import load_inventory

from meshdeploy.config.checks import warnings_for
from meshdeploy.core.loading import load_cluster
from meshdeploy.config.sources import HfSource, OllamaSource, PathSource
from meshdeploy.errors import PlanError
from meshdeploy.roles.services.argv import llama_server_argv, rpc_server_argv

ROOT = Path(__file__).resolve().parents[2]
INVENTORIES = sorted((ROOT / "inventories").glob("*.yaml"))
GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def model_path(cluster, name: str, prefix: str) -> str:
    source = cluster.model(name).source
    if isinstance(source, HfSource):
        return f"{prefix}/models/{name}/{source.files[0]}"
    if isinstance(source, OllamaSource):
        return f"{prefix}/models/{name}/{source.model}-{source.tag}.gguf"
    assert isinstance(source, PathSource)
    return source.path


def render(inventory: Path) -> str:
    cluster = load_inventory(inventory)
    lines = [f"# {inventory.name}: cluster {cluster.name}"]
    for warning in warnings_for(cluster):
        lines.append(f"# warning: {warning}")
    for host, rpc in cluster.rpc_servers():
        bindir = f"{host.layout.prefix}/current/bin"
        argv, env = rpc_server_argv(f"{bindir}/ggml-rpc-server", host, rpc,
                                    f"{host.layout.prefix}/cache/rpc-{rpc.port}")
        lines.append(f"# {host.name} {rpc.unit_name}")
        lines.append(shlex.join([f"{k}={v}" for k, v in sorted(env.items())] + argv))
    for server in cluster.servers:
        prefix = cluster.host(server.host).layout.prefix
        argv = llama_server_argv(f"{prefix}/current/bin/llama-server", cluster, server,
                                 model_path(cluster, server.model, prefix))
        lines.append(f"# {server.host} {server.unit_name}")
        lines.append(f"# -ts devices: {', '.join(cluster.devices_for(server)) or 'none'}")
        lines.append(shlex.join(argv))
    return "\n".join(lines) + "\n"


def test_every_inventory_has_a_golden():
    names = {p.stem for p in INVENTORIES}
    assert {"lab", "one-mac-mtl0-cpu", "two-macs-config-a", "two-macs-config-b",
            "android-cpu-mesh", "two-cuda-11-16"} <= names
    if not os.environ.get("MESHDEPLOY_UPDATE_GOLDEN"):
        assert {p.stem for p in GOLDEN.glob("*.txt")} == names


@pytest.mark.parametrize("inventory", INVENTORIES, ids=lambda p: p.stem)
def test_golden(inventory: Path):
    golden.check(GOLDEN / f"{inventory.stem}.txt", render(inventory))


@pytest.fixture
def lab():
    return load_cluster(ROOT / "inventories" / "lab.yaml")


def with_server(cluster, **changes):
    server = dataclasses.replace(cluster.servers[0], **changes)
    return dataclasses.replace(cluster, servers=(server,)), server


def test_rpc_none_and_no_rpc_servers_emit_no_rpc_flag(lab):
    for rpc in (None, ()):
        cluster, server = with_server(lab, rpc=rpc)
        argv = llama_server_argv("llama-server", cluster, server, "/m.gguf")
        assert "--rpc" not in argv
        assert argv[:7] == ["llama-server", "-m", "/m.gguf", "--host", "127.0.0.1",
                            "--port", "8080"]


def test_load_mode_falls_back_to_no_mmap_on_older_binaries(lab):
    cluster, server = with_server(lab, load_mode="none")
    old = frozenset({"-m", "--host", "--port", "--rpc", "-ngl", "-c", "--no-mmap", "--mmap"})
    argv = llama_server_argv("llama-server", cluster, server, "/m.gguf", flags=old)
    assert argv[-1] == "--no-mmap" and "-lm" not in argv
    assert llama_server_argv("llama-server", cluster, server, "/m.gguf")[-3:-1] == ["-lm", "none"]


def test_load_mode_unknown_to_binary_is_an_error(lab):
    cluster, server = with_server(lab, load_mode="none")
    bare = frozenset({"-m", "--host", "--port", "--rpc", "-ngl", "-c"})
    with pytest.raises(PlanError, match="neither -lm/--load-mode nor"):
        llama_server_argv("llama-server", cluster, server, "/m.gguf", flags=bare)


def test_missing_required_option_is_an_error_not_a_silent_drop(lab):
    cluster, server = with_server(lab, api_key_file="/etc/key")
    flags = frozenset({"-m", "--host", "--port", "--rpc", "-ngl", "-c"})
    with pytest.raises(PlanError, match="no --api-key-file option"):
        llama_server_argv("llama-server", cluster, server, "/m.gguf", flags=flags)


def test_long_option_names_are_used_when_short_ones_are_absent(lab):
    flags = frozenset({"--model", "--host", "--port", "--rpc", "--n-gpu-layers",
                       "--tensor-split", "--ctx-size"})
    cluster, server = with_server(lab, tensor_split=(1.0, 3.0))
    argv = llama_server_argv("llama-server", cluster, server, "/m.gguf", flags=flags)
    assert argv[1] == "--model"
    assert argv[argv.index("--tensor-split") + 1] == "1,3"
    assert "--n-gpu-layers" in argv and "--ctx-size" in argv


def test_rpc_server_cache_sets_llama_cache(lab):
    host = lab.host("node2")
    rpc = dataclasses.replace(host.rpc_servers[0], cache=True, threads=2, device="CPU")
    argv, env = rpc_server_argv("rpc", host, rpc, "/var/cache/x")
    assert argv == ["rpc", "-H", "10.200.0.12", "-p", "50052", "-d", "CPU", "-t", "2", "-c"]
    assert env == {"LLAMA_CACHE": "/var/cache/x"}


def test_public_bind_warns(lab):
    host = lab.host("node2")
    public = dataclasses.replace(host, rpc_servers=(
        dataclasses.replace(host.rpc_servers[0], bind="0.0.0.0"),))
    cluster = dataclasses.replace(lab, hosts=(lab.hosts[0], public, lab.hosts[2]))
    assert warnings_for(lab) == []
    (warning,) = warnings_for(cluster)
    assert warning.startswith("rpc-server on node2 binds every interface (port 50052): RPC is "
                              "unauthenticated and unencrypted")


def test_a_served_bind_that_nobody_may_reach_warns(lab):
    server = dataclasses.replace(lab.servers[0], bind="10.200.0.11",
                                 api_key_file="/etc/meshdeploy/api-key")
    cluster = dataclasses.replace(lab, servers=(server,))
    (warning,) = warnings_for(cluster)
    assert "servers.main.allow is empty" in warning
    allowed = dataclasses.replace(cluster, servers=(dataclasses.replace(
        server, allow=("10.200.0.0/24",)),))
    assert warnings_for(allowed) == []
    off = dataclasses.replace(cluster, network=dataclasses.replace(cluster.network,
                                                                   firewall=False))
    assert not any("allow is empty" in w for w in warnings_for(off))
