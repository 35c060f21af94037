"""The repository's Vagrantfile booted for real: three libvirt VMs, hosts.yaml, plan, apply.

Run by scripts/vagrant-lab (marker `vagrant`), which starts libvirtd inside a network namespace
of its own and runs this module there; skipped anywhere else (MESHDEPLOY_VAGRANT_LAB unset).
Figures (boot time per VM, memory, the plan) go to $MESHDEPLOY_VAGRANT_REPORT as JSON.
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


def _cluster_file(hosts_yaml: str, ssh_config: Path) -> dict:
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
        "network": {"rpc_bind": "address", "allow_public": False},
        # No model or server: the plan asks huggingface.co for a model's size, and the machine
        # that runs this test may not reach it.
        "hosts": hosts,
    }


def test_vagrantfile_boots_and_plans(vagrant_dir: Path, report: dict):
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
        YAML().dump(_cluster_file(hosts.stdout, ssh_config), f)

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
