"""What hosts reach on the bridge address: the apt proxy and the git and Hugging Face mirrors.

Each service listens on the machine's loopback only; a socat pair relays it into the lab
namespace through a UNIX socket (no route, no lab address in the machine's namespace).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from meshdeploy.lab import procs
from meshdeploy.lab.errors import LabError
from meshdeploy.lab.net import BRIDGE_ADDRESS

PROXY_PORT = 3142
GIT_PORT = 9418
HF_PORT = 8080
# Where the control machine reaches the default lab's HF mirror (inventories/lab.yaml).
HF_API_PORT = 18080
DEFAULT_LAB = "mdlab"  # core.DEFAULT_NAME; core imports this module


def _tinyproxy_conf(port: int) -> str:
    user = "tinyproxy" if _has_user("tinyproxy") else "nobody"
    group = "tinyproxy" if _has_user("tinyproxy") else "nogroup"
    # No LogFile/Syslog: in the foreground tinyproxy logs to stdout, which spawn() captures.
    return "\n".join(
        [
            f"User {user}",
            f"Group {group}",
            f"Port {port}",
            "Listen 127.0.0.1",
            "Timeout 600",
            "MaxClients 200",
            "Allow 127.0.0.1",
            "LogLevel Notice",
            "DisableViaHeader Yes",
            "",
        ]
    )


def _has_user(name: str) -> bool:
    try:
        import pwd

        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _relay(lab: str, run_dir: Path, name: str, lab_port: int, local_port: int, marker: str,
           bind: str = BRIDGE_ADDRESS):
    """Inside the namespace `lab`, `bind`:`lab_port` reaches 127.0.0.1:`local_port` here,
    through a UNIX socket in `run_dir` (no route between the two is needed)."""
    sock = run_dir / f"{name}.sock"
    if len(str(sock)) > 100:
        raise LabError(f"lab state dir path too long for a UNIX socket: {sock}; use a shorter one")
    local = procs.running(run_dir, f"{name}-local", marker)
    if local and f"TCP:127.0.0.1:{local_port}" not in procs.cmdline(local):
        procs.kill_all([local])  # the service restarted on another port
        local = None
    if not local:
        procs.spawn(
            ["socat", f"UNIX-LISTEN:{sock},fork,unlink-early,mode=600",
             f"TCP:127.0.0.1:{local_port}"],
            run_dir, f"{name}-local", marker,
        )
    if not procs.running(run_dir, f"{name}-lab", marker):
        procs.spawn(
            ["ip", "netns", "exec", lab, "socat",
             f"TCP-LISTEN:{lab_port},bind={bind},fork,reuseaddr",
             f"UNIX-CONNECT:{sock}"],
            run_dir, f"{name}-lab", marker,
        )


def _port_of(run_dir: Path, name: str) -> int | None:
    try:
        return int((run_dir / f"{name}.port").read_text())
    except (OSError, ValueError):
        return None


def _service(run_dir: Path, name: str, marker: str, argv_for_port,
             preferred: int | None = None) -> int:
    """Start a loopback service once; returns its port (kept when already running)."""
    port = _port_of(run_dir, name)
    if port and procs.running(run_dir, name, marker):
        return port
    port = preferred if preferred and procs.port_free(preferred) else procs.free_port()
    pid = procs.spawn(argv_for_port(port), run_dir, name, marker)
    (run_dir / f"{name}.port").write_text(str(port))
    procs.wait_tcp(port, name, pid=pid)
    return port


def start_proxy(lab: str, run_dir: Path, marker: str, bind: str = BRIDGE_ADDRESS,
                advertise: str = BRIDGE_ADDRESS) -> str:
    """An apt proxy (tinyproxy) here, reached from the namespace `lab` on `bind`:3142; its URL
    as the namespace's hosts dial it, on `advertise`."""
    if shutil.which("tinyproxy") is None:
        raise LabError("tinyproxy is missing: install tinyproxy (Debian package)")
    conf = run_dir / "tinyproxy.conf"

    def argv(port):
        conf.write_text(_tinyproxy_conf(port))
        return ["tinyproxy", "-d", "-c", str(conf)]

    port = _service(run_dir, "proxy", marker, argv)
    _relay(lab, run_dir, "proxy", PROXY_PORT, port, marker, bind)
    return f"http://{advertise}:{PROXY_PORT}"


def start_git(lab: str, run_dir: Path, marker: str, cache: Path) -> dict:
    try:
        from meshdeploy.lab import gitmirror
    except ImportError as exc:
        raise LabError(f"the git mirror module is not available ({exc})") from exc
    repo = gitmirror.ensure_repo(cache / "git")
    path = Path(repo["path"])

    def argv(port):
        return ["git", "daemon", "--export-all", f"--base-path={path.parent}", "--reuseaddr",
                "--listen=127.0.0.1", f"--port={port}", "--informative-errors"]

    port = _service(run_dir, "git", marker, argv)
    _relay(lab, run_dir, "git", GIT_PORT, port, marker)
    return {"git_url": f"git://{BRIDGE_ADDRESS}/{path.name}", "git_tags": dict(repo["tags"])}


def start_hf(lab: str, run_dir: Path, marker: str, cache: Path) -> dict:
    try:
        from meshdeploy.lab import hfstore
    except ImportError as exc:
        raise LabError(f"the Hugging Face mirror module is not available ({exc})") from exc
    root = cache / "hf"
    model = hfstore.ensure_gemma_repo(root)
    # The default lab keeps the port inventories/lab.yaml names for the control machine.
    preferred = HF_API_PORT if lab == DEFAULT_LAB else None
    return {**serve_hf(lab, run_dir, marker, "hf", root, HF_PORT, preferred=preferred),
            "hf_model": model}


def serve_hf(lab: str, run_dir: Path, marker: str, name: str, root: Path, lab_port: int,
             args: tuple[str, ...] = (), preferred: int | None = None) -> dict:
    """A Hugging Face mirror of `root` (meshdeploy.lab.hfmirror, with its `args`: --gated ...)
    on the bridge at `lab_port`; its requests are logged to <run_dir>/<name>.log."""

    def argv(port):
        return [sys.executable, "-m", "meshdeploy.lab.hfmirror", "--root", str(root),
                "--bind", "127.0.0.1", "--port", str(port), "--verbose", *args]

    port = _service(run_dir, name, marker, argv, preferred)
    _relay(lab, run_dir, name, lab_port, port, marker)
    return {"hf_endpoint": f"http://{BRIDGE_ADDRESS}:{lab_port}",
            "hf_api_endpoint": f"http://127.0.0.1:{port}"}
