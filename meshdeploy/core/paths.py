"""Where things live on a host, for every path more than one role (or the status view) uses.

Under llama_cpp.prefix the llama_cpp role installs the clone, its cmake trees, the builds and
the `current` link; services runs binaries from a build, status reads `current`'s manifest.
The models role puts each model's files under models/<name>/; services hands the first to
llama-server's -m and rpc_cache seeds a worker's cache from it. rpc-server's tensor cache is
the unit's CacheDirectory: services sets LLAMA_CACHE to it, rpc_cache fills its rpc/ folder.
The role variables (llama_cpp_src_dir, models_dir) are defined here and named again by their
roles' defaults.py, so the roles' READMEs still list them.
"""

from __future__ import annotations

import json

from meshdeploy.config.distribution import MODEL_SHARE_PORT
from meshdeploy.config.model import rpc_unit_name
from meshdeploy.config.sources import HfSource, OllamaSource, PathSource

# --- layout under llama_cpp.prefix ----------------------------------------------------------
llama_cpp_src_dir = "src/llama.cpp"        # the clone
llama_cpp_build_dir = "build"              # cmake build trees, one per (backend, flags)
llama_cpp_builds_dir = "builds"            # installed builds, one per (commit, backend, flags)
llama_cpp_current_link = "current"         # -> builds/<key>, flipped only after a good build
models_dir = "models"                      # models/<name>/<file>

# --- model distribution ----------------------------------------------------------------------
# The port of md-share (core/share.py): config.distribution's, which the cluster file's checks
# claim on each sharing host.
model_share_port = MODEL_SHARE_PORT

OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"


def llama_cpp_paths(prefix: str) -> dict[str, str]:
    return {"src": f"{prefix}/{llama_cpp_src_dir}",
            "build": f"{prefix}/{llama_cpp_build_dir}",
            "builds": f"{prefix}/{llama_cpp_builds_dir}",
            "current": f"{prefix}/{llama_cpp_current_link}"}


def installed_build(prefix: str, key: str) -> str:
    """The installed build `key` (llama_cpp's build_key): bin/ and its manifest."""
    return f"{prefix}/{llama_cpp_builds_dir}/{key}"


def model_dir(prefix: str, name: str) -> str:
    return f"{prefix}/{models_dir}/{name}"


def model_files(cluster, name: str) -> list[str]:
    """File names meshdeploy keeps in model_dir for model `name` (none for a path source)."""
    src = cluster.models[name].source
    if isinstance(src, HfSource):
        return list(src.files)
    if isinstance(src, OllamaSource):
        return ["model.gguf"]
    return []


def model_path(cluster, name: str, host) -> str:
    """The path of model `name` on `host`, as llama-server's -m gets it (the first part of a
    split GGUF): under the host's prefix (Layout.prefix), or the file's own path."""
    src = cluster.models[name].source
    if isinstance(src, PathSource):
        return src.path
    return f"{model_dir(host.layout.prefix, name)}/{model_files(cluster, name)[0]}"


def ollama_blob(fact: dict) -> tuple[str, str]:
    """("sha256:<hex>", blob path) of the GGUF layer an OllamaManifest fact names; ValueError
    ("is not JSON" / "has no ... layer") when the manifest does not name one."""
    try:
        layers = json.loads(fact["manifest"]).get("layers", [])
    except ValueError:
        raise ValueError("is not JSON") from None
    layer = next((x for x in layers if x.get("mediaType") == OLLAMA_MODEL_MEDIA), None)
    if layer is None:
        raise ValueError(f"has no {OLLAMA_MODEL_MEDIA} layer")
    digest = layer["digest"]
    return digest, f"{fact['store']}/blobs/sha256-{digest.split(':', 1)[1]}"


def ssh_key(layout) -> str:
    """network.transport: ssh: an orchestrator's private key for its forwards (the public key
    beside it, .pub); made on the host, never read off it."""
    return f"{layout.config}/ssh/rpc_ed25519"


def ssh_known_hosts(layout) -> str:
    """network.transport: ssh: the workers' host keys an orchestrator's forwards accept, pinned
    from what the probe read on each worker over meshdeploy's own checked connection."""
    return f"{layout.config}/ssh/known_hosts"


def rpc_server_cache(layout, port: int) -> str:
    """rpc-server's LLAMA_CACHE on a host of `layout` (config.model.Layout): its unit's systemd
    CacheDirectory under /var/cache, or a folder of the user's cache on a rootless host."""
    return f"{layout.cache}/{rpc_unit_name(port)}"


def rpc_cache_dir(layout, port: int) -> str:
    """Where rpc-server -c keeps its tensor entries: $LLAMA_CACHE/rpc."""
    return f"{rpc_server_cache(layout, port)}/rpc"
