"""Defaults of the models role (see README.md)."""

# --- layout ---------------------------------------------------------------------------------------
# under llama_cpp.prefix: models/<name>/<file>; services and rpc_cache read the files too, so
# it is defined in meshdeploy.core.paths.
from meshdeploy.core.paths import models_dir  # noqa: F401 (this role's variable)

models_verified_suffix = ".meshdeploy-verified"   # "<size> <mtime> <sha256>" of a checked file
models_partial_suffix = ".part"            # downloads resume into this name, then rename

# --- downloads ------------------------------------------------------------------------------------
models_curl_retries = 5
models_disk_headroom_bytes = 512 * 1024 * 1024   # keep this much free after a download
