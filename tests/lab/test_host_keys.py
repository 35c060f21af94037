"""Host keys against a real sshd: an unknown host is refused by default, recorded with
--accept-new-host-keys, and a regenerated key is refused with its fingerprint and the fix,
before anything logs in.

Runs on its own one-host lab, `mdkey` (no mirrors, no llama.cpp build). The lab's own
ssh_config turns checking off; these tests reach node1 through an ssh_config of their own, with
a temporary known_hosts and HOME, never root's ~/.ssh.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from conftest import own_lab
from support.cli import meshdeploy
from support.resolved import run_values

from meshdeploy.errors import CONNECT, OK

pytestmark = pytest.mark.lab

KEY_LAB = "mdkey"
HOST = "node1"
FINGERPRINT = re.compile(r"offered (\S+) key (SHA256:[A-Za-z0-9+/]{43})")


@pytest.fixture(scope="module")
def key_lab(lab_available, request):
    """LabInfo of lab mdkey (node1 only), always removed afterwards."""
    with own_lab(request, KEY_LAB, hosts=1, mirrors=False) as (info, _):
        yield info


@pytest.fixture(scope="module")
def setup(key_lab, tmp_path_factory):
    """(cluster file, known_hosts, environment): node1 through an ssh_config that says nothing
    about StrictHostKeyChecking, so meshdeploy's default applies."""
    tmp = tmp_path_factory.mktemp("hostkeys")
    home = tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    known_hosts = tmp / "known_hosts"
    host = key_lab.host(HOST)
    config = tmp / "ssh_config"
    config.write_text(f"Host {HOST}\n    HostName {HOST}\n    User deploy\n"
                      f"    IdentityFile {key_lab.ssh['key']}\n    IdentitiesOnly yes\n"
                      f"    UserKnownHostsFile {known_hosts}\n"
                      f"    ProxyCommand ip netns exec {host.netns} nc 127.0.0.1 22\n")
    cluster = tmp / "cluster.yaml"
    cluster.write_text("cluster: hostkeys\nllama_cpp: {ref: b11312}\nhosts:\n"
                       f"  {HOST}:\n    address: {host.address}\n"
                       f"    ssh: {{user: deploy, config: {config}, sudo: true}}\n")
    env = {**os.environ, "HOME": str(home)}
    return cluster, known_hosts, env



def host_fingerprint(lab, key_type: str) -> str:
    """What `ssh-keygen -l` says on node1 about its key of `key_type` (ssh-ed25519, ...)."""
    kind = key_type.removeprefix("ssh-").split("-")[0]
    proc = lab.run(HOST, ["ssh-keygen", "-lf", f"/etc/ssh/ssh_host_{kind}_key.pub"], check=True)
    return proc.stdout.split()[1]


def logins(lab) -> int:
    """Logins sshd accepted on node1 so far, this one (journalctl's own session) included."""
    proc = lab.run(HOST, "sudo journalctl -q --no-pager -o cat _COMM=sshd", check=True)
    return proc.stdout.count("Accepted publickey for deploy")


def test_unknown_host_is_refused_by_default_with_its_fingerprint(key_lab, setup):
    cluster, known_hosts, env = setup
    done = meshdeploy("status", cluster, env=env)
    assert done.returncode == CONNECT
    assert "Traceback" not in done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith(f"host key of {HOST} is unknown: {HOST} offered "), first
    key_type, fingerprint = FINGERPRINT.search(first).groups()
    assert fingerprint == host_fingerprint(key_lab, key_type)
    assert "--accept-new-host-keys" in done.stderr
    assert f"hosts.{HOST}.ssh.host_key: accept-new" in done.stderr
    assert not known_hosts.exists() or known_hosts.read_text() == ""


def test_accept_new_records_the_key_then_strict_accepts_it(key_lab, setup):
    cluster, known_hosts, env = setup
    done = meshdeploy("status", "--accept-new-host-keys", cluster, env=env)
    assert done.returncode == OK, done.stderr
    (line,) = known_hosts.read_text().splitlines()
    name, key_type, blob = line.split()
    assert name == HOST
    pub = key_lab.run(HOST, f"cat /etc/ssh/ssh_host_{key_type.removeprefix('ssh-').split('-')[0]}"
                            "_key.pub", check=True).stdout.split()
    assert [key_type, blob] == pub[:2]
    # Known now: the strict default lets it in without the flag.
    assert meshdeploy("status", cluster, env=env).returncode == OK


def test_changed_key_is_refused_with_fingerprint_and_fix_and_nothing_applied(key_lab, setup):
    cluster, known_hosts, env = setup
    recorded = known_hosts.read_text()
    assert recorded, "runs after test_accept_new_records_the_key_then_strict_accepts_it"
    key_lab.run(HOST, "sudo sh -c 'rm -f /etc/ssh/ssh_host_*; ssh-keygen -A -q; "
                      "systemctl restart ssh'", check=True)
    before = logins(key_lab)
    # Even the flag that accepts unknown keys refuses a changed one; apply stops before the
    # probe.
    done = meshdeploy("apply", "--auto-approve", "--accept-new-host-keys", cluster, env=env)
    # One more login: the one that reads the journal, none from apply.
    assert logins(key_lab) == before + 1, "a session logged in past a changed host key"
    assert done.returncode == CONNECT
    assert "Applying" not in done.stdout and "Traceback" not in done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith(f"host key of {HOST} changed: {HOST} offered "), first
    key_type, fingerprint = FINGERPRINT.search(first).groups()
    assert fingerprint == host_fingerprint(key_lab, key_type)
    assert f"ssh-keygen -R {HOST} -f {known_hosts}" in done.stderr
    assert "nothing was changed on any host" in done.stderr
    assert known_hosts.read_text() == recorded
    assert key_lab.run(HOST, "test -e /opt/meshdeploy").returncode != 0

    # The fix the hint gives works.
    subprocess.run(["ssh-keygen", "-R", HOST, "-f", str(known_hosts)], check=True,
                   capture_output=True)
    before = logins(key_lab)
    assert meshdeploy("status", "--accept-new-host-keys", cluster, env=env).returncode == OK
    assert known_hosts.read_text() != recorded
    # The login count sees meshdeploy's logins: status's and the journal reader's.
    assert logins(key_lab) == before + 2


# -- the API key file on a real host ---------------------------------------------------------

KEY_FILE = "/etc/meshdeploy-test/api key"


def key_file_check(lab, tmp_path):
    """The services preflight on node1's real KeyFile fact, read as the probe reads it (sudo)."""
    from meshdeploy.core.loading import load_cluster
    from meshdeploy.core import probe, shell
    from meshdeploy.core.context import HostContext
    from meshdeploy.roles.services import operations
    from meshdeploy.roles.services.facts import KeyFile

    path = tmp_path / "server.yaml"
    path.write_text("cluster: keyfile\nllama_cpp: {ref: b11312}\n"
                    f"hosts: {{{HOST}: {{address: {lab.host(HOST).address}}}}}\n"
                    "models: {m: {path: /srv/m.gguf}}\n"
                    f"servers: {{main: {{host: {HOST}, model: m, rpc: none, bind: 0.0.0.0, "
                    f"api_key_file: '{KEY_FILE}'}}}}\n")
    cluster = load_cluster(path)
    (section,) = [s for s in operations.sections(cluster, cluster.host(HOST))
                  if s.fact is KeyFile]
    assert section.privileged
    out = lab.run(HOST, shell.sudo(section.fact().command(**section.kwargs)), check=True)
    facts = probe.decode([section], {section.key: out.stdout.splitlines()})
    operations.preflight(HostContext(cluster, cluster.host(HOST), facts, run_values()))
    return facts[section.key]


def test_api_key_file_must_be_root_only_on_the_host(key_lab, tmp_path):
    from meshdeploy.errors import PlanError

    key_lab.run(HOST, ["sudo", "rm", "-rf", "/etc/meshdeploy-test"], check=True)
    with pytest.raises(PlanError, match="does not exist"):
        key_file_check(key_lab, tmp_path)
    # What an operator easily does: the key written as the login user, readable by all.
    key_lab.run(HOST, "sudo install -d -m 700 /etc/meshdeploy-test && "
                      "sudo install -m 644 -o deploy /dev/null '/etc/meshdeploy-test/api key'",
                check=True)
    with pytest.raises(PlanError) as info:
        key_file_check(key_lab, tmp_path)
    assert str(info.value).endswith("is mode 0644, owned by deploy: only root may read it")
    # The hint's own commands fix it.
    fix = info.value.hint.split(";")[0]
    key_lab.run(HOST, fix, check=True)
    assert key_file_check(key_lab, tmp_path) == {"exists": True, "mode": 0o600, "uid": 0,
                                                  "owner": "root"}
