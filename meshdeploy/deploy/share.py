"""md-share: a host's verified model files served to the cluster's other hosts during an apply.

One internet download per model: the host of a model's first llama-server downloads it
(models.gguf), and the other hosts get their bytes from that copy over the LAN, never from the
internet again. Two roles start md-share (templates/md-share.py, Python's standard library) on
that host, each with what its step needs:

- models.gguf, while a host that keeps a whole GGUF copies it: the file, served from its
  partial as it arrives (`--growing`), so the copy trails the download;
- rpc_cache.share, while a worker misses tensors: the verified file, for ranged GETs.

A later start replaces an earlier one (the pid file); md-share answers loopback and the hosts
named, on the host's cluster address (its tunnel address under WireGuard), and exits by itself
once idle. network.allowlist opens its port to the same hosts alone.
"""

from __future__ import annotations

from pathlib import Path

from meshdeploy.deploy import shell
from meshdeploy.deploy.paths import model_share_port

SERVER = Path(__file__).with_name("templates") / "md-share.py"
NAME = "md-share.py"  # under llama_cpp.prefix/tools
PYTHON = "python3"
IDLE = 300  # seconds without a request before md-share exits
MAX = 6 * 3600  # and at the latest this long after it started
WAIT = 120  # seconds a growing file may stall before a reply is cut short
PID = "/run/meshdeploy/md-share.pid"
LOG = "/var/log/meshdeploy-share.log"

# Inputs: PY, SERVER (md-share.py), PID, LOG, HOST, PORT; its arguments in "$@". An md-share left
# by an earlier step or run is stopped first (it may serve other files). The server writes PID
# once it listens; its output goes to LOG, so the SSH channel closes when this script ends.
_START = ('command -v "$PY" >/dev/null 2>&1 || { echo "$HOST: no $PY to run md-share; the '
          'toolchain role installs it" >&2; exit 1; }\n'
          'if [ -f "$PID" ]; then kill "$(cat "$PID")" 2>/dev/null || true; i=0; '
          'while [ -f "$PID" ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done; '
          'rm -f "$PID"; fi\n'
          'mkdir -p "$(dirname "$PID")" "$(dirname "$LOG")"\n'
          'setsid "$PY" "$SERVER" --pid-file "$PID" "$@" </dev/null >>"$LOG" 2>&1 &\n'
          'S=$!; i=0\n'
          'until [ -f "$PID" ]; do\n'
          '  kill -0 "$S" 2>/dev/null || { echo "$HOST: md-share did not start:" >&2; '
          'tail -n 5 "$LOG" >&2; exit 1; }\n'
          '  i=$((i + 1)); [ $i -lt 100 ] || { echo "$HOST: md-share did not listen within 10 s" >&2; '
          'exit 1; }\n'
          '  sleep 0.1\n'
          'done\n'
          'echo "md-share serving on port $PORT"')


def server_path(prefix: str) -> str:
    return f"{prefix}/tools/{NAME}"


def url(cluster, source: str, sha256: str) -> str:
    """Where another host fetches the file whose content is `sha256` from host `source`.

    md-share names files by their sha256, never by model: an md-share an earlier step or run
    left running (it stays until idle) may serve other bytes under a model's name, and a
    client that read those would only find out at its final sha256 check. By content, such a
    server answers 404 until the new one replaces it, and the client tries again."""
    address = cluster.source_address(cluster.host(source))
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{model_share_port}/models/{sha256}"


def start(cluster, host, files: dict[str, str], clients, growing: dict | None = None) -> list[str]:
    """The commands that (re)start md-share on `host` for `clients` (Hosts).

    + files: sha256 of a file -> its path on `host`
    + growing: sha256 -> (partial path, final size), for a file still being downloaded
    """
    args = ["--bind", cluster.source_address(host), "--port", model_share_port,
            "--idle", IDLE, "--max", MAX, "--wait", WAIT]
    for address in sorted({cluster.source_address(c) for c in clients}):
        args += ["--allow", address]
    for name, path in files.items():
        args += ["--file", f"{name}={path}"]
    for name, (partial, size) in (growing or {}).items():
        args += ["--growing", f"{name}={partial}:{int(size)}"]
    return [shell.write_file(server_path(cluster.llama_cpp.prefix), SERVER.read_text(), "0755"),
            shell.script(_START, args=args, PY=PYTHON, SERVER=server_path(cluster.llama_cpp.prefix),
                         PID=PID, LOG=LOG, HOST=host.name, PORT=model_share_port)]
