"""Command lines of rpc-server and llama-server, as pure functions of the cluster model.

Kept apart from the unit templates so every inventory's exact commands can be golden-tested
without a host, and so flags that moved between llama.cpp versions are decided in one place.
"""

from __future__ import annotations

from dataclasses import replace as _replace

from meshdeploy.config.model import Cluster, Host, RpcServer, Server
from meshdeploy.errors import PlanError

# Option names llama-server's --help lists in the tree meshdeploy is tested against (b11312):
# -lm/--load-mode replaced --mmap/--no-mmap/--mlock/--direct-io there.
# The llama_cpp role's section of the cluster file (its ref names the build in an error).
LLAMA_CPP = "llama_cpp"

UPSTREAM_FLAGS = frozenset({
    "-m", "--model", "--host", "--port", "--rpc", "-ngl", "--gpu-layers", "--n-gpu-layers",
    "-ts", "--tensor-split", "-c", "--ctx-size", "--api-key-file", "-lm", "--load-mode",
    "--metrics",
})

# For binaries without -lm: the older flags that give the same loading behaviour.
LEGACY_LOAD_MODE = {
    "auto": (),  # the old default: mmap where possible
    "none": ("--no-mmap",),
    "mmap": ("--mmap",),
    "mlock": ("--no-mmap", "--mlock"),
    "mmap+mlock": ("--mlock",),
    "dio": ("--direct-io",),
}


def device_env(host: Host) -> dict:
    """What the host's llama.cpp processes need in their environment to see the devices the
    file gives them: GGML_VK_VISIBLE_DEVICES on a vulkan host that names its devices (without
    it ggml-vulkan picks its own, and never a driver that runs on the CPU)."""
    if host.backend == "vulkan" and host.vulkan_visible:
        return {"GGML_VK_VISIBLE_DEVICES": ",".join(str(i) for i in host.vulkan_visible)}
    return {}


def rpc_server_argv(binary: str, host: Host, rpc: RpcServer,
                    cache_dir: str) -> tuple[list[str], dict]:
    """argv and environment of one rpc-server.

    + binary: absolute path of rpc-server (ggml-rpc-server in current trees)
    + cache_dir: LLAMA_CACHE for -c; rpc-server keeps its tensors under $LLAMA_CACHE/rpc
    Example: (["/opt/meshdeploy/current/bin/ggml-rpc-server", "-H", "10.0.0.5", "-p", "50052"], {})
    """
    argv = [binary, "-H", rpc.bind, "-p", str(rpc.port)]
    if rpc.device is not None:
        argv += ["-d", rpc.device]
    if rpc.threads:
        argv += ["-t", str(rpc.threads)]
    env = device_env(host)
    if rpc.cache:
        argv.append("-c")
        env["LLAMA_CACHE"] = cache_dir
    return argv, env


def llama_server_argv(binary: str, cluster: Cluster, server: Server, model_path: str,
                      flags: frozenset[str] | None = None) -> list[str]:
    """argv of one llama-server, using only options the built binary knows.

    + flags: option names from the binary's --help; None = the upstream tree (UPSTREAM_FLAGS)
    + model_path: the GGUF on the host (the first part for split models)
    Raises PlanError when a setting needs an option the binary lacks.
    """
    known = UPSTREAM_FLAGS if flags is None else flags

    def opt(*aliases: str) -> str:
        for alias in aliases:
            if alias in known:
                return alias
        raise PlanError(
            f"llama-server at {binary} has no {'/'.join(aliases)} option "
            f"(server {server.name})",
            f"build a llama.cpp that has it (llama_cpp.ref is {cluster.sections[LLAMA_CPP]['ref']}) or "
            "remove the setting that needs it")

    argv = [binary, opt("-m", "--model"), model_path,
            opt("--host"), server.bind, opt("--port"), str(server.port)]
    endpoints = cluster.rpc_endpoints(server)
    if endpoints:
        # An empty --rpc makes llama-server refuse to start (seed ernos): only emit with values.
        argv += [opt("--rpc"), ",".join(e.target for e in endpoints)]
    argv += [opt("-ngl", "--gpu-layers", "--n-gpu-layers"), str(server.n_gpu_layers)]
    if server.tensor_split != "auto":
        argv += [opt("-ts", "--tensor-split"), ",".join(f"{v:g}" for v in server.tensor_split)]
    argv += [opt("-c", "--ctx-size"), str(server.ctx_size)]
    if server.api_key_file is not None:
        argv += [opt("--api-key-file"), server.api_key_file]
    if server.load_mode is not None:
        argv += load_mode_args(server, known, binary)
    # /metrics (Prometheus text; behind the API key when there is one): `status` reads each
    # server's tokens/s from it. A binary without the flag still serves, without the figure.
    if "--metrics" in known and "--metrics" not in server.extra_args:
        argv.append("--metrics")
    argv += list(server.extra_args)
    return argv


def load_mode_args(server: Server, known: frozenset[str], binary: str) -> list[str]:
    mode = server.load_mode
    for alias in ("-lm", "--load-mode"):
        if alias in known:
            return [alias, mode]
    legacy = LEGACY_LOAD_MODE.get(mode)
    if legacy is not None and all(flag in known for flag in legacy):
        return list(legacy)
    raise PlanError(
        f"llama-server at {binary} supports neither -lm/--load-mode nor the older flags for "
        f"load_mode '{mode}' (server {server.name})",
        "remove servers.{0}.load_mode or build a llama.cpp that supports it".format(server.name))


def failover_argv(python: str, script: str, binary: str, cluster: Cluster, server: Server,
                  model_path: str, runs, flags: frozenset[str] | None = None,
                  state: str | None = None) -> list[str]:
    """argv of md-failover (templates/md-failover.py) running `server` with its placements.

    + runs: placement.failover.Run tuple: the full placement first, then one per set of
      workers it may lose; runs that cannot serve are left out (md-failover is then down
      while that set is away)
    + state: where md-failover says which placement runs, and beside it, the Unix socket
      llama-server listens on behind md-failover's front; None: $RUNTIME_DIRECTORY's (where
      there is none, as under launchd, llama-server holds its address itself)
    Example: ["python3", ".../md-failover-1a2b3c4d5e6f.py", "--worker",
              "node2=10.200.0.12:50052", "--placement", "-", "10.200.0.12:50052,...", "-",
              ..., "--", "/opt/.../llama-server", "-m", ...]
    """
    known = UPSTREAM_FLAGS if flags is None else flags
    base = llama_server_argv(binary, cluster, _replace(server, rpc=None, tensor_split="auto"),
                             model_path, flags)
    target = {e.ref: e.target for e in cluster.rpc_endpoints(server)}
    # -I: neither the script's folder nor PYTHON* variables nor user site-packages count.
    # md-failover holds the server's address, llama-server behind it on a Unix socket beside
    # the state file: requests wait there while it switches placements.
    bind = f"[{server.bind}]" if ":" in server.bind else server.bind
    argv = [python, "-I", script, f"--url={server.local_url}", f"--front={bind}:{server.port}"]
    if state is not None:
        argv += ["--state", state]
    rpc_flag = next((f for f in ("--rpc",) if f in known), None)
    ts_flag = next((f for f in ("-ts", "--tensor-split") if f in known), None)
    if rpc_flag is None or ts_flag is None:
        raise PlanError(f"llama-server at {binary} has no --rpc or -ts option "
                        f"(server {server.name})", "build a llama.cpp that has both")
    # One word each: a value that starts with "-" would read as an option of its own.
    argv += [f"--rpc-flag={rpc_flag}", f"--ts-flag={ts_flag}"]
    for name in cluster.worker_hosts(server):
        targets = [e.target for e in cluster.rpc_endpoints(server) if e.host.name == name]
        argv += ["--worker", f"{name}={','.join(targets)}"]
    for run in runs:
        if run.layout is None:
            continue
        argv += ["--placement", ",".join(run.lost) or "-",
                 ",".join(target[r] for r in run.rpc) or "-",
                 "-" if run.split is None else ",".join(f"{v:g}" for v in run.split)]
    return argv + ["--"] + base
