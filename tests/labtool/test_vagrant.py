"""The Vagrantfile (checked by `vagrant validate`) and the ssh-config -> hosts conversion."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from meshdeploy.lab import vagrant
from meshdeploy.lab.errors import LabError

REPO_ROOT = Path(__file__).resolve().parents[2]
VAGRANTFILE = REPO_ROOT / "Vagrantfile"

# What `vagrant ssh-config` prints for this Vagrantfile under VirtualBox (Vagrant 2.3).
SSH_CONFIG = """\
Host orchestrator
  HostName 127.0.0.1
  User vagrant
  Port 2222
  UserKnownHostsFile /dev/null
  StrictHostKeyChecking no
  PasswordAuthentication no
  IdentityFile /home/alice/mesh/.vagrant/machines/orchestrator/virtualbox/private_key
  IdentitiesOnly yes
  LogLevel FATAL
  PubkeyAcceptedKeyTypes +ssh-rsa
  HostKeyAlgorithms +ssh-rsa

Host worker1
  HostName 127.0.0.1
  User vagrant
  Port 2200
  UserKnownHostsFile /dev/null
  StrictHostKeyChecking no
  PasswordAuthentication no
  IdentityFile "/home/alice/my mesh/.vagrant/machines/worker1/virtualbox/private_key"
  IdentitiesOnly yes
  LogLevel FATAL

Host worker2
  HostName 192.168.121.57
  User vagrant
  Port 22
  IdentityFile /home/alice/mesh/.vagrant/machines/worker2/libvirt/private_key
  IdentityFile /home/alice/.vagrant.d/insecure_private_keys/vagrant.key.ed25519
"""


def _vagrant_env(tmp_path: Path) -> dict:
    # No update checks (no network), and no state in the user's ~/.vagrant.d.
    return {**os.environ, "VAGRANT_HOME": str(tmp_path / "vagrant.d"),
            "VAGRANT_CHECKPOINT_DISABLE": "1", "VAGRANT_BOX_UPDATE_CHECK_DISABLE": "1"}


def _need_vagrant() -> None:
    if shutil.which("vagrant") is None:
        if os.environ.get("MESHDEPLOY_REQUIRE_LAB") == "1":
            pytest.fail("vagrant is not installed and MESHDEPLOY_REQUIRE_LAB=1 (apt-get install vagrant)")
        pytest.skip("vagrant is not installed (apt-get install vagrant)")


def _validate(tmp_path: Path, text: str) -> subprocess.CompletedProcess:
    # A copy, so validate's .vagrant/ state lands in tmp, not in the repository.
    # --ignore-provider: a machine without VirtualBox or libvirt (CI, this lab) has no usable
    # provider, and plain `validate` then fails before reading the file. Everything but the
    # provider blocks is still checked (the typo test below proves it).
    work = tmp_path / "vm"
    work.mkdir(exist_ok=True)
    (work / "Vagrantfile").write_text(text)
    return subprocess.run(["vagrant", "validate", "--ignore-provider"], cwd=work,
                          env=_vagrant_env(tmp_path),
                          capture_output=True, text=True, timeout=120)


def test_vagrant_validate(tmp_path):
    _need_vagrant()
    proc = _validate(tmp_path, VAGRANTFILE.read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_vagrant_validate_catches_a_typo(tmp_path):
    _need_vagrant()
    broken = VAGRANTFILE.read_text().replace("node.vm.hostname =", "node.vm.hostnam =")
    proc = _validate(tmp_path, broken)
    assert proc.returncode != 0 and "hostnam" in proc.stdout + proc.stderr


def test_vagrantfile_provisions_nothing_meshdeploy_does():
    text = VAGRANTFILE.read_text()
    assert 'MESHDEPLOY_BOX = ENV.fetch("MESHDEPLOY_BOX", "debian/bookworm64")' in text
    script = text.split("<<~SHELL", 1)[1].split("\n  SHELL", 1)[0]
    installs = [line.split("install", 1)[1].split() for line in script.splitlines()
                if "apt-get install" in line]
    assert installs and all(
        {w for w in words if not w.startswith("-")} == {"python3", "sudo"} for words in installs)
    assert text.count("config.vm.provision") == 1


def test_private_ips_from_the_vagrantfile():
    assert vagrant.private_ips_from_vagrantfile(VAGRANTFILE.read_text()) == {
        "orchestrator": "192.168.56.10", "worker1": "192.168.56.11", "worker2": "192.168.56.12"}


def test_hosts_from_ssh_config():
    hosts = vagrant.cluster_hosts_from_ssh_config(SSH_CONFIG, vagrantfile=VAGRANTFILE)
    assert hosts == [
        {"name": "orchestrator", "address": "192.168.56.10",
         "ssh": {"user": "vagrant", "port": 22,
                 "key": "/home/alice/mesh/.vagrant/machines/orchestrator/virtualbox/private_key"}},
        {"name": "worker1", "address": "192.168.56.11",
         "ssh": {"user": "vagrant", "port": 22,
                 "key": "/home/alice/my mesh/.vagrant/machines/worker1/virtualbox/private_key"}},
        {"name": "worker2", "address": "192.168.56.12",
         "ssh": {"user": "vagrant", "port": 22,
                 "key": "/home/alice/mesh/.vagrant/machines/worker2/libvirt/private_key"}},
    ]


def test_ssh_port_kept_when_not_forwarded():
    text = "Host n1\n  HostName 10.0.0.5\n  User admin\n  Port 2022\n"
    (host,) = vagrant.cluster_hosts_from_ssh_config(text, {"n1": "10.0.0.5"})
    assert host["ssh"] == {"user": "admin", "port": 2022, "key": ""}


def test_missing_private_ip_is_an_error():
    with pytest.raises(LabError, match="host worker2 has no private-network address"):
        vagrant.cluster_hosts_from_ssh_config(SSH_CONFIG, {"orchestrator": "192.168.56.10",
                                                           "worker1": "192.168.56.11"})
    with pytest.raises(LabError, match="before any Host"):
        vagrant.cluster_hosts_from_ssh_config("  User vagrant\n", {})


def test_command_prints_hosts_yaml(tmp_path):
    saved = tmp_path / "ssh-config"
    saved.write_text(SSH_CONFIG)
    proc = subprocess.run([sys.executable, "-m", "meshdeploy.lab.vagrant", "--ssh-config",
                           str(saved), "--vagrantfile", str(VAGRANTFILE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = YAML(typ="safe").load(proc.stdout)
    assert list(doc["hosts"]) == ["orchestrator", "worker1", "worker2"]
    assert doc["hosts"]["worker1"] == {
        "address": "192.168.56.11",
        "ssh": {"user": "vagrant", "port": 22, "sudo": True,
                "key": "/home/alice/my mesh/.vagrant/machines/worker1/virtualbox/private_key"}}


def test_command_reports_bad_ip_argument(tmp_path):
    saved = tmp_path / "ssh-config"
    saved.write_text(SSH_CONFIG)
    proc = subprocess.run([sys.executable, "-m", "meshdeploy.lab.vagrant", "--ssh-config",
                           str(saved), "--ip", "worker1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "expected NAME=IPv4" in proc.stderr
