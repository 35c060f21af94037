"""Looking for secrets where they must not be: on a lab host (files, process arguments and
environments, the journal) and on the control machine (meshdeploy's output, the files next to the
cluster file, meshdeploy's cache). The secrets travel on stdin, never in an argument.

Used by tests/lab/test_secrets.py (HF token, API key) and tests/lab/test_wireguard_lab.py (WireGuard
private keys).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

from meshdeploy.lab import hosts

# Runs as root on a host; secrets arrive on stdin (never in an argument, which ps and sudo's
# journal entries would show). Prints one JSON line per (kind, where, secret index) found.
SCAN = r"""
import json, os, subprocess, sys
secrets = [s.encode() for s in sys.stdin.read().split("\n") if s]
out = []
def check(kind, where, data):
    for i, s in enumerate(secrets):
        if s in data:
            out.append([kind, where, i])
def walk(top):
    for dirpath, dirs, files in os.walk(top):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                if os.path.islink(path) or not os.path.isfile(path):
                    continue
                if os.path.getsize(path) > 64 << 20:
                    continue  # the GGUF
                with open(path, "rb") as f:
                    check("file", path, f.read())
            except OSError:
                pass
for top in ("/etc/systemd/system", "/run/systemd", "/tmp", "/var/tmp", "/run",
            "/etc/meshdeploy-secrets", "/etc/meshdeploy", "/etc/wireguard",
            "/opt/meshdeploy/models", "/root", "/home"):
    walk(top)
check("ps", "ps -eo args", subprocess.run(["ps", "-eo", "args"], capture_output=True).stdout)
for pid in filter(str.isdigit, os.listdir("/proc")):
    for what in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{what}", "rb") as f:
                check(what, pid, f.read())
        except OSError:
            pass
check("journal", "journalctl", subprocess.run(["journalctl", "--no-pager", "-o", "verbose"],
                                                capture_output=True).stdout)
print(json.dumps(out))
"""




def ssh(lab, host: str, command: str, stdin: str = "", timeout: float = 120):
    return subprocess.run(hosts.ssh_argv(Path(lab.ssh["config"]), host, command), input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def scan(lab, host: str, secrets: dict[str, str]) -> set[tuple]:
    """{(host, kind, where, secret name)} for every place on `host` holding one of `secrets`
    (name -> value); kind is file, ps, cmdline, environ or journal."""
    names = list(secrets)
    proc = ssh(lab, host, f"sudo python3 -c {shlex.quote(SCAN)}",
               "\n".join(secrets.values()) + "\n")
    assert proc.returncode == 0, proc.stderr
    return {(host, kind, where, names[i]) for kind, where, i in json.loads(proc.stdout)}


def control_texts(runs: dict, folder: Path) -> dict[str, str]:
    """Where meshdeploy could have written a secret on the control machine: each run's stdout
    and stderr (runs: name -> CompletedProcess), every file under the cluster file's folder
    (saved plans, the lock file) and meshdeploy's cache."""
    texts = {f"{name} {stream}": getattr(proc, stream)
             for name, proc in runs.items() for stream in ("stdout", "stderr")}
    texts |= {str(p): p.read_text(errors="replace") for p in folder.rglob("*") if p.is_file()}
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshdeploy"
    if cache.is_dir():
        texts |= {str(p): p.read_text(errors="replace") for p in cache.rglob("*")
                  if p.is_file() and p.stat().st_size < 64 << 20}
    return texts
