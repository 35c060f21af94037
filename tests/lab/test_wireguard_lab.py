"""network.transport: wireguard on real hosts: three lab hosts (wireguard-go: this kernel has no
WireGuard module) plus node4, a rogue host in no cluster file.

First the plain transport (inventories/lab.yaml) on the same hosts, to show what the tunnel
changes: a packet capture on the lab bridge during a model load holds a 64-byte window of a
weight tensor that the placement sends to node2, and with node2's allow-list deleted by hand the
rogue connects to node2:50052. Then inventories/lab-wireguard.yaml: chat through the tunnel; the
same capture holds no such window but plenty of WireGuard UDP; the rogue can neither handshake
nor reach the rpc port; each host's private key is only in its key file (not in any plan, plan
file, lock file, output, unit, process or journal); after a reboot the tunnel comes up before
the units that use it and chat works; `-replace=network.wireguard` rotates every key in one
apply.

Runs on its own lab, `mdwg`, never the shared `mdlab`.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import own_lab
from support import capture, cut, leaks, wire
from support.labfile import for_lab
from test_cluster import idle_workers
from support.cli import meshdeploy

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import shell
from meshdeploy.placement.tensors import weight_tensors

pytestmark = [pytest.mark.lab, pytest.mark.build]

WG_LAB = "mdwg"
REPO = Path(__file__).resolve().parents[2]
INVENTORY = REPO / "inventories" / "lab-wireguard.yaml"
PLAIN = REPO / "inventories" / "lab.yaml"
CAPTURE = REPO / "tests" / "support" / "capture.py"
NODES = ("node1", "node2", "node3")
IFACE, PORT, WG_PORT = "mdwg0", 50052, 51820
KEY_FILE = f"/etc/meshdeploy/wireguard/{IFACE}.key"  # network_wg_key_dir
PROBE = ("import socket, sys\n"
         "try:\n"
         "    socket.create_connection((sys.argv[1], int(sys.argv[2])), 3.0).close()\n"
         "    print('open')\n"
         "except OSError as e:\n"
         "    print('closed', type(e).__name__)\n")


@pytest.fixture(scope="module")
def wg_lab(lab_available, request):
    """LabInfo of lab mdwg (node1..node3 + rogue node4, mirrors), always removed afterwards."""
    with own_lab(request, WG_LAB, hosts=3, rogue=1, toolchain=True) as (info, _):
        yield info



def root(lab, host: str, command: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = lab.run(host, shell.sudo(command), timeout=120)
    if check:
        assert proc.returncode == 0, f"{host}: {command[:300]}: {proc.stderr}"
    return proc


def reach(lab, source: str, address: str, port: int) -> str:
    proc = lab.run(source, ["python3", "-c", PROBE, address, str(port)], timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def public_keys(lab) -> dict:
    return {h: root(lab, h, shell.command("wg", "show", IFACE, "public-key")).stdout.strip()
            for h in ("node1", "node2", "node3")}


def chat(lab) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 8, "temperature": 0})
    proc = lab.run("node1", ["curl", "-sf", "--max-time", "120", "-H",
                             "Content-Type: application/json", "-d", body,
                             "http://127.0.0.1:8080/v1/chat/completions"], timeout=180)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def lab_file(lab, inventory: Path, folder: Path) -> Path:
    """`inventory` pointed at lab `lab`'s mirrors and ssh_config, written into `folder`."""
    text = inventory.read_text()
    text = for_lab(text, lab)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / inventory.name
    target.write_text(text)
    return target


@pytest.fixture(scope="module")
def plain_file(wg_lab, tmp_path_factory):
    return lab_file(wg_lab, PLAIN, tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def plain(plain_file):
    """The plain transport applied; its placement (plan --json) for the capture's window."""
    applied = meshdeploy("apply", plain_file, "--auto-approve")
    assert applied.returncode == 0, applied.stderr
    plan = meshdeploy("plan", plain_file, "--json", "--detailed-exitcode")
    assert plan.returncode == 0, plan.stdout
    return json.loads(plan.stdout)


@pytest.fixture(scope="module")
def window(plain, gemma):
    """(tensor name, 64 bytes of it, bytes one load sends to the workers): a window with high
    entropy (at least 40 distinct byte values) from the biggest tensor under rpc-server's
    hash threshold (sent in full at every load, seeded cache or not) that the placement puts
    on node2."""
    [row] = [r for p in plain["placement"] for r in p["rows"] if r["host"] == "node2"]
    layers = range(row["first_layer"], row["last_layer"] + 1)
    candidates = sorted((t for t in weight_tensors(gemma) if t.layer in layers and not t.hashed),
                        key=lambda t: -t.size)
    wire_total = sum(r["wire_bytes"] for p in plain["placement"] for r in p["rows"]
                     if r["port"] is not None)
    with open(gemma, "rb") as f:
        for t in candidates:
            f.seek(t.offset + t.size // 2)
            chunk = f.read(4096)
            for i in range(0, len(chunk) - 64, 64):
                if len(set(chunk[i:i + 64])) >= 40:
                    print(f"window: {t.name} ({t.size} bytes) at +{t.size // 2 + i}")
                    return t.name, chunk[i:i + 64], wire_total
    raise AssertionError(f"no high-entropy window in node2's tensors of layers {layers}")


def capture_a_load(lab, folder: Path) -> tuple[dict, Path]:
    """Capture the bridge's RPC and WireGuard frames while node1's llama-server restarts and
    loads the model (until /health 200); (capture summary, capture file)."""
    out = folder / "frames.bin"
    proc = subprocess.Popen(["ip", "netns", "exec", lab.name, sys.executable, str(CAPTURE),
                             str(out), str(PORT), str(WG_PORT)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        seconds = wire.restart_server(lab)
    finally:
        proc.send_signal(signal.SIGTERM)
        tail = proc.communicate(timeout=120)[0]
    summary = json.loads(tail.strip().splitlines()[-1])
    print(f"load: {seconds:.1f} s; capture: {summary}; {out.stat().st_size} bytes")
    return summary, out


def window_in(lab, path: Path, data: bytes) -> dict:
    """Where a capture holds `data` (in one frame, in a reassembled TCP stream); the TCP
    connections to a worker's rpc port on the bridge that were opened during the capture and
    the bytes they carried; the bytes of older such connections whose segments merely crossed
    it (a kernel retransmitting what a stopped llama-server last sent); the WireGuard UDP
    bytes; and every other TCP flow seen (a client's port may happen to be one of ours)."""
    flows = capture.flows(path)
    workers = {lab.host(h).address for h in NODES[1:]}
    opened = {c for c in capture.opened(path) if c[2] in workers and c[3] == PORT}

    def rpc(k):
        return k[0] == "tcp" and ((k[3] in workers and k[4] == PORT) or
                                  (k[1] in workers and k[2] == PORT))

    def new(k):
        return k[1:] in opened or (k[3], k[4], k[1], k[2]) in opened
    return {"frame": any(data in frame for _, frame in capture.frames(path)),
            "stream": any(data in v for k, v in flows.items() if k[0] == "tcp"),
            "rpc connections opened": len(opened),
            "rpc tcp bytes": sum(len(v) for k, v in flows.items() if rpc(k) and new(k)),
            "older rpc flows": {" ".join(map(str, k)): (len(v), v[:16]) for k, v in
                                flows.items() if rpc(k) and not new(k)},
            "other tcp": {" ".join(map(str, k)): v[:24] for k, v in flows.items()
                          if k[0] == "tcp" and not rpc(k)},
            "wireguard udp bytes": sum(v["bytes"] for k, v in flows.items()
                                       if k[0] == "udp" and WG_PORT in (k[2], k[4]))}


def test_plain_rpc_carries_the_weights_in_clear(wg_lab, plain, window, tmp_path):
    """The check can fail: with the plain transport, the window is on the wire."""
    name, data, wire_total = window
    summary, frames = capture_a_load(wg_lab, tmp_path)
    seen = window_in(wg_lab, frames, data)
    print(f"plain: {seen}; {name}; the placement sends {wire_total} bytes per load")
    assert seen["stream"], seen
    assert seen["rpc connections opened"] >= 2, seen  # one per worker at least
    assert seen["rpc tcp bytes"] >= wire_total * 0.9, (seen, wire_total, summary)


def test_before_the_lockdown_the_rogue_reaches_the_rpc_port(wg_lab, plain):
    """What the tunnel later refuses the rogue: node2:50052 on the bridge. With the plain
    allow-list it is already filtered; with node2's table deleted by hand, the rogue gets in
    (llama-server stopped meanwhile: rpc-server accepts one client at a time)."""
    rogue, worker = wg_lab.rogue[0], wg_lab.host("node2").address
    with idle_workers(wg_lab):
        assert reach(wg_lab, rogue, worker, PORT).startswith("closed")
        root(wg_lab, "node2", shell.command("nft", "delete", "table", "inet", "meshdeploy"))
        assert reach(wg_lab, rogue, worker, PORT) == "open"


@pytest.fixture(scope="module")
def cluster_file(wg_lab, tmp_path_factory):
    return lab_file(wg_lab, INVENTORY, tmp_path_factory.mktemp("wg"))


@pytest.fixture(scope="module")
def converged(cluster_file):
    """The first plan and the apply (with --debug) that made the tunnel and its keys."""
    plan = meshdeploy("plan", cluster_file, "--detailed-exitcode")
    assert plan.returncode == 2, plan.stderr
    applied = meshdeploy("apply", cluster_file, "--auto-approve", "--debug")
    assert applied.returncode == 0, applied.stderr
    return {"first plan": plan, "apply --debug": applied}


def test_first_plan_shows_the_tunnel_with_keys_known_after_apply(converged):
    out = converged["first plan"].stdout
    assert "node1/network.wireguard will be created" in out
    assert "known after apply" in out
    assert "PrivateKey" not in out and "private-key " not in out.replace(
        "wg set %i private-key", "")


def test_chat_goes_through_the_tunnel_and_workers_listen_on_it_only(wg_lab, converged,
                                                                    cluster_file):
    cluster = load_cluster(cluster_file)
    answer = chat(wg_lab)
    assert answer["choices"][0]["message"]["content"]
    for worker in ("node2", "node3"):
        tunnel = cluster.network.wireguard.address(worker)
        listening = root(wg_lab, worker, shell.command("ss", "-ltnH")).stdout
        ours = [line.split()[3] for line in listening.splitlines() if line.split()[3].endswith(
            f":{PORT}")]
        assert ours == [f"{tunnel}:{PORT}"], listening
        # The tunnel really carried it: node1's peer entry for the worker saw a handshake.
        shakes = root(wg_lab, "node1", shell.command("wg", "show", IFACE,
                                                     "latest-handshakes")).stdout.split()
        assert all(int(v) > 0 for v in shakes[1::2]), shakes


def test_the_next_plan_says_no_changes(converged, cluster_file):
    proc = meshdeploy("plan", cluster_file, "--detailed-exitcode")
    assert proc.returncode == 0, proc.stdout
    assert "No changes." in proc.stdout


def test_a_silent_cut_of_a_workers_tunnel_switches_the_placement(wg_lab, converged, cluster_file):
    """Under WireGuard a worker's link that drops silently (node3's WireGuard port dropped both
    ways inside its namespace: no handshake, no RST) is noticed as on the plain transport
    (llama-server's connections through the tunnel carry md-failover's keepalive and user
    timeout): md-failover switches to the placement without node3, chat answers, status says
    degraded; back once the link is."""
    from meshdeploy.roles.network import settings

    state = "/run/meshdeploy-server-main/failover.json"
    s = cut.wait_state(wg_lab, "node1", state, cut.serving([]), 120, root=True)
    assert cut.serving([])(s), s
    port = settings.WireGuard.listen_port  # the file leaves network.wireguard to defaults
    assert "listen_port" not in cluster_file.read_text()
    started = time.monotonic()
    with cut.silent_cut(wg_lab, "node3", port, proto="udp"):
        s = cut.wait_state(wg_lab, "node1", state, cut.serving(["node3"]), 120, root=True)
        switched = time.monotonic() - started
        assert cut.serving(["node3"])(s), s
        assert chat(wg_lab)["choices"][0]["message"]["content"]
        cut.assert_degraded(cluster_file, "node3")
    back = time.monotonic()
    s = cut.wait_state(wg_lab, "node1", state, cut.serving([]), 120, root=True)
    assert cut.serving([])(s), s
    assert chat(wg_lab)["choices"][0]["message"]["content"]
    print(f"WireGuard, node3's tunnel cut silently: switched {switched:.1f} s after the cut, "
          f"full placement {time.monotonic() - back:.1f} s after it came back")


def test_a_rogue_host_cannot_handshake_nor_reach_the_rpc_port(wg_lab, converged, cluster_file):
    cluster = load_cluster(cluster_file)
    rogue = wg_lab.rogue[0]
    worker = wg_lab.host("node2").address
    tunnel = cluster.network.wireguard.address("node2")
    node2_key = public_keys(wg_lab)["node2"]
    # Before anything: the rogue's own tunnel config naming node2 as its peer.
    root(wg_lab, rogue, shell.script(
        'umask 077; mkdir -p /etc/wireguard; wg genkey > /etc/wireguard/rogue.key\n'
        'printf "[Interface]\\nAddress = 10.99.250.250/16\\nPostUp = wg set %%i private-key '
        '/etc/wireguard/rogue.key\\n\\n[Peer]\\nPublicKey = %s\\nAllowedIPs = %s/32\\n'
        'Endpoint = %s:%s\\n" "$KEY" "$TUNNEL" "$WORKER" "$PORT" > /etc/wireguard/rogue.conf\n'
        'wg-quick up rogue', KEY=node2_key, TUNNEL=tunnel, WORKER=worker, PORT=WG_PORT))
    try:
        assert reach(wg_lab, rogue, tunnel, PORT).startswith("closed")
        time.sleep(6)
        shakes = root(wg_lab, rogue, shell.command("wg", "show", "rogue",
                                                   "latest-handshakes")).stdout.split()
        assert shakes[1] == "0", shakes
    finally:
        root(wg_lab, rogue, shell.command("wg-quick", "down", "rogue"), check=False)
    # Over the bridge: rpc-server does not even listen there, and the port is filtered.
    assert reach(wg_lab, rogue, worker, PORT).startswith("closed")


def test_wireguard_carries_no_weight_bytes_in_clear(wg_lab, converged, window, tmp_path):
    """The same load as test_plain_rpc_carries_the_weights_in_clear, through the tunnel: the
    window is in no frame and no TCP stream, no RPC connection is opened over the bridge, and
    the capture holds WireGuard UDP worth at least half of what the placement sends and of what
    node1's wg counted (so an empty or broken capture cannot pass; it held 318-323 MB, both
    directions, for 312-316 MB node1 sent and 247 MB of weights).

    Segments of an RPC connection older than the capture may cross it: the plain llama-server,
    stopped when the tunnel came, asked its workers for their memory as it exited, and the
    workers' new allow-list drops their answer, so node1's kernel retransmits those 13 bytes
    (GET_DEVICE_MEMORY of device 0) for minutes. They are printed, and the window check still
    covers them."""
    name, data, wire_total = window
    counted = shell.command("wg", "show", IFACE, "transfer")
    before = root(wg_lab, "node1", counted).stdout.split()
    summary, frames = capture_a_load(wg_lab, tmp_path)
    after = root(wg_lab, "node1", counted).stdout.split()
    sent = sum(int(a) - int(b) for a, b in zip(after[2::3], before[2::3]))
    seen = window_in(wg_lab, frames, data)
    print(f"wireguard: {seen}; {name}; the placement sends {wire_total} bytes per load; "
          f"node1's wg counted {sent} bytes sent")
    assert not seen["frame"] and not seen["stream"], seen
    assert seen["rpc connections opened"] == 0 and seen["rpc tcp bytes"] == 0, seen
    assert seen["wireguard udp bytes"] >= max(wire_total, sent) / 2, (seen, wire_total, sent,
                                                                       summary)


def test_private_keys_are_only_in_their_key_files(wg_lab, converged, cluster_file):
    """Each host's private key (read as root over SSH into this process, never printed) is in
    its own key file, where the scan must find it (so it can fail), and nowhere else: not on
    any host's units, processes, journal, /etc/wireguard or /tmp, nor in plan text, plan
    --json, a saved plan, the lock file or meshdeploy's output with --debug."""
    keys = {}
    for host in NODES:
        proc = leaks.ssh(wg_lab, host, shell.sudo(shell.command("cat", KEY_FILE)))
        assert proc.returncode == 0, proc.stderr
        keys[f"{host} private key"] = proc.stdout.strip()
    assert all(len(k) == 44 and k.endswith("=") for k in keys.values())
    assert len(set(keys.values())) == 3
    found = set()
    for host in NODES:
        found |= leaks.scan(wg_lab, host, keys)
    homes = {(h, "file", KEY_FILE, f"{h} private key") for h in NODES}
    assert homes <= found, sorted(homes - found)
    assert found - homes == set(), sorted(found - homes)
    folder = cluster_file.parent
    runs = {**converged,
            "plan": meshdeploy("plan", cluster_file),
            "plan --json": meshdeploy("plan", cluster_file, "--json"),
            "plan -out": meshdeploy("plan", cluster_file, "-out", folder / "saved.plan"),
            "no-op apply --debug": meshdeploy("apply", cluster_file, "--auto-approve",
                                              "--debug")}
    assert all(p.returncode == 0 for p in runs.values() if p is not converged["first plan"])
    texts = leaks.control_texts(runs, folder)
    names = {Path(where).name for where in texts if where.startswith(str(folder))}
    assert "saved.plan" in names and any(n.endswith(".lock.json") for n in names), names
    leaked = [(where, name) for where, text in texts.items()
              for name, value in keys.items() if value in text]
    assert leaked == []


def started_at(lab, host: str, unit: str, prop: str) -> int:
    out = lab.run(host, shell.command("systemctl", "show", "-p", prop, "--value", unit)).stdout
    return int(out.strip() or 0)


def test_after_a_reboot_the_tunnel_comes_first_and_chat_works(wg_lab, converged):
    """node1 and node2 rebooted: wg-quick@mdwg0 is up before rpc-server and llama-server start
    (After=/Wants=), node2's rpc-server listens on its tunnel address, and chat works."""
    booted = {}
    for host in ("node2", "node1"):
        booted[host] = wg_lab.run(host, "cut -d' ' -f22 /proc/1/stat").stdout.strip()
        wg_lab.run(host, "sudo systemctl reboot")
    deadline = time.monotonic() + 180
    for host in ("node2", "node1"):
        while True:
            time.sleep(1)
            now = wg_lab.run(host, "systemctl is-system-running; cut -d' ' -f22 /proc/1/stat",
                             timeout=15).stdout.split()
            if now[-1:] and now[-1] != booted[host] and now[0] in ("running", "degraded"):
                break
            assert time.monotonic() < deadline, f"{host} did not come back: {now}"
    tunnel_up = {h: started_at(wg_lab, h, f"wg-quick@{IFACE}", "ActiveEnterTimestampMonotonic")
                 for h in ("node1", "node2")}
    rpc = started_at(wg_lab, "node2", "meshdeploy-rpc-50052", "ExecMainStartTimestampMonotonic")
    server = started_at(wg_lab, "node1", "meshdeploy-server-main",
                        "ExecMainStartTimestampMonotonic")
    print(f"tunnel up {tunnel_up}, rpc-server started {rpc}, llama-server started {server}")
    assert 0 < tunnel_up["node2"] <= rpc and 0 < tunnel_up["node1"] <= server
    after = wg_lab.run("node2", shell.command("systemctl", "show", "-p", "After", "--value",
                                              "meshdeploy-rpc-50052")).stdout
    assert f"wg-quick@{IFACE}.service" in after.split(), after
    # It started once, on an address that existed (without the order it may fail to bind).
    assert started_at(wg_lab, "node2", "meshdeploy-rpc-50052", "NRestarts") == 0
    healthy = wg_lab.run("node1", "for i in $(seq 300); do curl -sf -m 2 "
                                  "http://127.0.0.1:8080/health >/dev/null && exit 0; sleep 1; "
                                  "done; exit 1", timeout=400)
    assert healthy.returncode == 0, "llama-server did not become healthy after the reboot"
    assert chat(wg_lab)["choices"][0]["message"]["content"]


def test_replace_rotates_every_key_in_one_apply(wg_lab, converged, cluster_file):
    before = public_keys(wg_lab)
    plan = meshdeploy("plan", cluster_file, "-replace=network.wireguard")
    assert plan.returncode == 0, plan.stderr
    assert "-/+" in plan.stdout and "forces replacement" in plan.stdout
    applied = meshdeploy("apply", cluster_file, "--auto-approve", "-replace=network.wireguard")
    assert applied.returncode == 0, applied.stderr
    after = public_keys(wg_lab)
    assert all(before[h] != after[h] for h in before), (before, after)
    assert chat(wg_lab)["choices"][0]["message"]["content"]
    again = meshdeploy("plan", cluster_file, "--detailed-exitcode")
    assert again.returncode == 0 and "No changes." in again.stdout, again.stdout


def wg_received(lab, host: str) -> int:
    """Bytes `host` has received through the tunnel, from every peer (`wg show ... transfer`)."""
    out = root(lab, host, shell.command("wg", "show", IFACE, "transfer")).stdout
    return sum(int(line.split()[1]) for line in out.splitlines() if line.strip())


def test_a_build_is_copied_through_the_tunnel(wg_lab, converged, cluster_file):
    """node2 and node3 lose their llama.cpp build (removed by hand): the plan has them copy
    node1's through the tunnel, an apply of the copy alone (no model load, so no weights on the
    tunnel) brings each at least the tarball's bytes through it, the copies are node1's
    binaries; restarted by hand (the build key is the same, so an apply has no reason to), the
    rpc-servers run the copies, and the next apply restarts llama-server after them (its
    workers hold no connection from it): chat, then the next plan says No changes."""
    prefix = "/opt/meshdeploy"
    for host in ("node2", "node3"):
        root(wg_lab, host, f"rm -rf {prefix}/builds {prefix}/current")
    plan = meshdeploy("plan", cluster_file)
    assert plan.returncode == 0, plan.stderr
    assert plan.stdout.count("from node1 through the WireGuard tunnel") >= 2, plan.stdout
    tarball = int(root(wg_lab, "node1", f"stat -c %s {prefix}/build/share/*.tar.gz").stdout
                  .split()[0])
    before = {h: wg_received(wg_lab, h) for h in ("node2", "node3")}
    copied = meshdeploy("apply", cluster_file, "--auto-approve", "-target=llama_cpp.copy")
    assert copied.returncode == 0, copied.stderr
    for host in ("node2", "node3"):
        assert wg_received(wg_lab, host) - before[host] >= tarball, (host, tarball)
        assert re.search(rf"(?m)^\s*{host}\s+llama_cpp\.copy\s+ok", copied.stdout), \
            copied.stdout
    binaries = {h: root(wg_lab, h, f"cd {prefix}/current/bin && sha256sum *").stdout
                for h in ("node1", "node2", "node3")}
    assert binaries["node2"] == binaries["node3"] == binaries["node1"] != "", binaries
    unit = "meshdeploy-rpc-50052"
    exe = f"readlink /proc/$(systemctl show -p MainPID --value {unit})/exe"
    for host in ("node2", "node3"):
        running = root(wg_lab, host, exe).stdout.strip()
        assert running.endswith("(deleted)"), (host, running)  # still the removed binary
        root(wg_lab, host, shell.command("systemctl", "restart", unit))
        running = root(wg_lab, host, exe).stdout.strip()
        assert running.startswith(f"{prefix}/builds/") and "deleted" not in running, \
            (host, running)
    # llama-server's connections to the workers' old processes are gone: the plan finds the
    # workers without their client (or llama-server already restarting, had a request met the
    # closed connection) and the apply restarts it.
    applied = meshdeploy("apply", cluster_file, "--auto-approve")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "services.llama_server[main]" in applied.stdout, applied.stdout
    assert chat(wg_lab)["choices"][0]["message"]["content"]
    again = meshdeploy("plan", cluster_file, "--detailed-exitcode")
    assert again.returncode == 0 and "No changes." in again.stdout, again.stdout
