"""The lab itself: real hosts over SSH through pyinfra, apt, both mirrors, and clean teardown."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import claim_lab

pytestmark = pytest.mark.lab

TEARDOWN_LAB = "mdlabtd"


def test_lab_json_describes_the_lab(lab):
    data = json.loads((Path(lab.state_dir) / "lab.json").read_text())
    # node1..node3 for the cluster file, then the rogue node4 that no cluster file names.
    assert [h["name"] for h in data["hosts"]] == ["node1", "node2", "node3", "node4"]
    assert [h["address"] for h in data["hosts"]] == [f"10.200.0.1{i}" for i in (1, 2, 3, 4)]
    assert [h["netns"] for h in data["hosts"]] == [f"{lab.name}-node{i}" for i in (1, 2, 3, 4)]
    assert data["rogue"] == ["node4"]
    assert data["bridge_address"] == "10.200.0.1"
    assert data["mirrors"]["apt_proxy"] == "http://10.200.0.1:3142"
    assert data["mirrors"]["git_url"] == "git://10.200.0.1/llama.cpp.git"
    assert data["mirrors"]["hf_endpoint"] == "http://10.200.0.1:8080"
    assert data["ccache_dir"] == "/var/cache/meshdeploy-ccache"
    from meshdeploy.lab import base

    assert data["base"] == base.recipe_hash(base.recipe())  # the session lab: no toolchain
    assert Path(data["ssh"]["key"]).exists() and Path(data["ssh"]["config"]).exists()


def test_every_host_answers_through_pyinfra(lab):
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.connect import connect_all
    from pyinfra.facts.server import Command, Hostname

    names = [h.name for h in lab.hosts]
    inventory = Inventory(
        (names, {}),
        override_data={"ssh_config_file": lab.ssh["config"], "ssh_user": "deploy",
                       "ssh_key": lab.ssh["key"]},
    )
    state = State(inventory, Config())
    connect_all(state)
    assert sorted(h.name for h in state.activated_hosts) == names

    machine_ids = set()
    for host in inventory:
        assert host.get_fact(Hostname) == host.name
        # Root through sudo, PID 1 is systemd and the host has its own address and identity.
        assert host.get_fact(Command, "sudo -n id -u") == "0"
        assert host.get_fact(Command, "cat /proc/1/comm") == "systemd"
        addr = host.get_fact(Command, "ip -4 -o addr show dev eth0")
        assert f"inet {lab.host(host.name).address}/24" in addr
        machine_ids.add(host.get_fact(Command, "cat /etc/machine-id"))
    assert len(machine_ids) == len(names)
    for host in inventory:
        host.disconnect()


def test_hosts_have_no_way_out_and_machine_has_no_lab_address(lab):
    for h in lab.hosts:
        # No route at all: nothing can leave a host except through the lab's own services.
        proc = lab.run(h.name, "ip route get 192.0.2.1")
        assert proc.returncode != 0 and "unreachable" in proc.stderr.lower()
    root_ns = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    root_routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    assert "10.200.0." not in root_ns + root_routes


def _install_and_fetch(lab, host: str) -> dict:
    proxy = shlex.quote(f"Acquire::http::Proxy={lab.mirrors['apt_proxy']}")
    apt = f"sudo DEBIAN_FRONTEND=noninteractive apt-get -q -o {proxy}"
    install = lab.run(host, f"{apt} update && {apt} install -y --no-install-recommends git curl")
    tag, sha = sorted(lab.mirrors["git_tags"].items())[-1]
    clone = lab.run(
        host,
        f"rm -rf /tmp/llama.cpp && git clone -q --depth 1 --branch {tag} "
        f"{lab.mirrors['git_url']} /tmp/llama.cpp && git -C /tmp/llama.cpp rev-parse HEAD",
    )
    model = lab.mirrors["hf_model"]
    url = f"{lab.mirrors['hf_endpoint']}/{model['repo']}/resolve/main/{model['file']}"
    head = lab.run(host, f"curl -sS --fail -r 0-1023 {url} | od -An -c -N4; "
                         f"curl -sS --fail -r 0-1023 {url} | wc -c")
    return {"install": install, "clone": clone, "sha": sha, "head": head}


def test_apt_proxy_and_mirrors_from_inside_every_host(lab):
    with ThreadPoolExecutor(len(lab.hosts)) as pool:
        results = dict(zip([h.name for h in lab.hosts],
                           pool.map(lambda h: _install_and_fetch(lab, h.name), lab.hosts)))
    for host, r in results.items():
        assert r["install"].returncode == 0, f"{host}: apt failed: {r['install'].stderr[-800:]}"
        assert r["clone"].returncode == 0, f"{host}: clone failed: {r['clone'].stderr}"
        assert r["clone"].stdout.strip() == r["sha"]
        assert r["head"].returncode == 0, f"{host}: curl failed: {r['head'].stderr}"
        magic, count = r["head"].stdout.strip().splitlines()
        assert magic.split() == ["G", "G", "U", "F"]
        assert count.strip() == "1024"


def test_hf_api_reachable_from_the_machine(lab):
    model = lab.mirrors["hf_model"]
    url = f"{lab.mirrors['hf_api_endpoint']}/api/models/{model['repo']}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        info = json.load(resp)
    assert info["id"] == model["repo"]
    assert model["file"] in [s["rfilename"] for s in info["siblings"]]


def test_ccache_is_shared_and_writable_by_any_user(lab):
    token = f"lab-{time.time_ns()}"
    wrote = lab.run("node1", f"echo {token} > {lab.ccache_dir}/probe-{token}")
    assert wrote.returncode == 0, wrote.stderr
    probe = f"{lab.ccache_dir}/probe-{token}"
    read = lab.run("node3", f"cat {probe} && rm {probe}")
    assert read.stdout.strip() == token


def _init_started(lab, host: str) -> str | None:
    # Field 22 of /proc/1/stat: when the host's PID 1 started, new after every reboot.
    proc = lab.run(host, "cut -d' ' -f22 /proc/1/stat", timeout=10)
    return proc.stdout.strip() if proc.returncode == 0 else None


def test_reboot_inside_a_host_comes_back(lab):
    first = _init_started(lab, "node2")
    identity = lab.run("node2", "cat /etc/machine-id").stdout
    assert first and identity
    lab.run("node2", "sudo systemctl reboot")
    deadline = time.monotonic() + 60
    now = None
    while time.monotonic() < deadline:
        time.sleep(1)
        now = _init_started(lab, "node2")
        if now and now != first:
            break
    assert now and now != first, "node2 did not come back after reboot"
    assert lab.run("node2", "cat /etc/machine-id").stdout == identity


def test_down_cleans_up_after_an_interrupted_up(lab_available):
    """An `up` killed midway leaves namespaces, mounts and processes that `down` must find."""
    from meshdeploy.lab.core import Lab, leftovers

    with claim_lab(TEARDOWN_LAB):
        _interrupt_and_clean(Lab(name=TEARDOWN_LAB), leftovers)


def _interrupt_and_clean(lab, leftovers) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshdeploy.lab", "up", "--name", TEARDOWN_LAB, "--hosts", "2",
         "--no-mirrors"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300  # a cold base is built first
    while time.monotonic() < deadline and proc.poll() is None:
        if any("/hosts/" in m for m in leftovers(TEARDOWN_LAB)["mounts"]):
            break  # a host root is mounted: interrupt now, mid-boot
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = leftovers(TEARDOWN_LAB)
    assert before["netns"] and before["processes"], f"nothing to clean up: {before}"

    lab.down()
    assert {k: v for k, v in leftovers(TEARDOWN_LAB).items() if v} == {}
    lab.down()  # safe to repeat
    assert lab.status() == []
