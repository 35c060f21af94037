"""Defaults of the models role (see README.md)."""

# --- layout ---------------------------------------------------------------------------------------
models_dir = "models"                      # under llama_cpp.prefix: models/<name>/<file>
models_verified_suffix = ".meshdeploy-verified"   # "<size> <mtime> <sha256>" of a checked file
models_partial_suffix = ".part"            # downloads resume into this name, then rename

# --- downloads ------------------------------------------------------------------------------------
models_curl_retries = 5
models_disk_headroom_bytes = 512 * 1024 * 1024   # keep this much free after a download
