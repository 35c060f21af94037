"""The state file is checked like the cluster file and trusted less (security review, issue 20):
a host that left the cluster file is reached only with settings the file itself uses. A crafted
state whose departed host names an ssh_config with a ProxyCommand (that would touch a marker
file here) is refused at its file:line:col by plan and destroy, run for real, and the marker is
never made. docs/security.md, "The state file", states the policy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from support.cli import meshdeploy

from meshdeploy import errors
from meshdeploy.core.loading import load_cluster
from meshdeploy.engine import state as states
from meshdeploy.errors import ConfigError
from meshdeploy.remote import ssh_settings

# One host on a port nothing listens on: every connection fails at once, none hangs.
CLUSTER = """cluster: t
llama_cpp: {ref: b11312}
hosts:
  node1:
    address: 127.0.0.1
    ssh: {port: 1, config: ssh_config}
"""


def _record(**changes) -> dict:
    ssh = {"user": "deploy", "port": 22, "key": None, "config": None, "sudo": True,
           "host_key": None, **changes.pop("ssh", {})}
    return {"address": "192.0.2.9", "ssh": ssh, "backend": "cpu", "status": "managed",
            "units": ["meshdeploy-rpc-50052"], "models": [], "firewall": True, "tunnel": None,
            "updated_at": "2026-01-01T00:00:00Z", "connection": "ssh", **changes}


@pytest.fixture
def crafted(tmp_path):
    """(cluster file, marker): the state names a departed host `evil` whose ssh_config's
    ProxyCommand would make the marker."""
    (tmp_path / "ssh_config").write_text("Host node1\n    HostName 127.0.0.1\n")
    marker = tmp_path / "proxy-command-ran"
    evil = tmp_path / "evil_ssh_config"
    evil.write_text(f"Host evil\n    ProxyCommand touch {marker}\n")
    path = tmp_path / "t.yaml"
    path.write_text(CLUSTER)
    _write_state(path, {"evil": _record(ssh={"config": str(evil)})})
    return path, marker


def _write_state(cluster_path: Path, hosts: dict) -> Path:
    state = states.state_path(cluster_path)
    state.write_text(json.dumps({"format_version": 1, "cluster": "t", "serial": 1,
                                 "updated_at": "2026-01-01T00:00:00Z", "hosts": hosts},
                                indent=2, sort_keys=True) + "\n")
    return state


def _position(state: Path, host: str, key: str) -> str:
    """line:col of `key`'s value in host's record, as the state file writes it."""
    lines = state.read_text().splitlines()
    start = lines.index(f'    "{host}": {{')
    n, line = next((n, line) for n, line in enumerate(lines[start:], start + 1)
                   if line.lstrip().startswith(f'"{key}":'))
    return f"{n}:{line.index(':') + 3}"


def test_the_record_would_run_its_proxy_command_here(crafted):
    """Why the state may not say this: reached with the record's settings, the connection runs
    the ssh_config's ProxyCommand on the control machine."""
    path, marker = crafted
    record = json.loads(states.state_path(path).read_text())["hosts"]["evil"]
    host = states._record("evil", record).host("/opt/meshdeploy")
    assert f"touch {marker}" in ssh_settings.resolve(host).proxy_command


def test_a_departed_host_with_an_ssh_config_of_the_state_alone_is_refused(crafted):
    path, marker = crafted
    state = states.state_path(path)
    with pytest.raises(ConfigError) as err:
        states.load(load_cluster(path))
    text = err.value.render()
    assert text.startswith(f"{state}:{_position(state, 'evil', 'config')}: hosts.evil.ssh.config:")
    assert "evil left the cluster file" in text and "ProxyCommand" in text
    assert "meshdeploy destroy FILE --limit evil" in err.value.hint
    assert err.value.exit_code == errors.CONFIG
    assert not marker.exists()


@pytest.mark.parametrize("command", [["plan"], ["destroy", "--auto-approve"]])
def test_plan_and_destroy_refuse_the_crafted_state_and_run_nothing(crafted, command, tmp_path):
    path, marker = crafted
    home = tmp_path / "home"
    home.mkdir()
    run = meshdeploy(*command[:1], path, *command[1:], timeout=120,
                     env={**os.environ, "HOME": str(home)}, cwd=tmp_path)
    assert not marker.exists(), "the state's ProxyCommand ran"
    assert run.returncode == errors.CONFIG, run.stdout + run.stderr
    assert "hosts.evil.ssh.config: evil left the cluster file" in run.stderr


def _refusal(tmp_path, record: dict) -> str:
    path = tmp_path / "t.yaml"
    path.write_text(CLUSTER)
    (tmp_path / "ssh_config").write_text("")
    _write_state(path, {"evil": record})
    with pytest.raises(ConfigError) as err:
        states.load(load_cluster(path))
    return err.value.render(verbose=True)


def test_a_departed_local_host_from_the_state_is_refused(tmp_path):
    text = _refusal(tmp_path, _record(connection="local"))
    assert "hosts.evil.connection: evil left the cluster file" in text
    assert "connection: local" in text


@pytest.mark.parametrize("weaker", ["no", "accept-new"])
def test_host_key_checking_is_not_weakened_by_the_state(tmp_path, weaker):
    """`accept-new` would pin whatever key the state's address offers first."""
    text = _refusal(tmp_path, _record(ssh={"host_key": weaker}))
    assert "hosts.evil.ssh.host_key: evil left the cluster file" in text
    assert f"(host_key: {weaker})" in text


@pytest.mark.parametrize("record, message", [
    (_record(address="-oProxyCommand=touch x"), "hosts.evil.address: '-oProxyCommand=touch x' "
                                                "is not an IPv4 address or DNS name"),
    (_record(backend="cudaa"), "hosts.evil.backend: 'cudaa' is not one of"),
    (_record(ssh={"port": 0}), "hosts.evil.ssh.port: 0 is out of range"),
    (_record(ssh={"user": "a\x1b[2Jb"}), "hosts.evil.ssh.user: contains a control character"),
    (_record(ssh={"key": "id_ed25519"}), "hosts.evil.ssh.key: 'id_ed25519' is not an absolute"),
    (_record(tunnel="wg0; reboot"), "hosts.evil.tunnel:"),
    (_record(units=["sshd"]), "hosts.evil.units[0]: 'sshd' does not match"),
])
def test_host_records_are_checked_with_the_cluster_files_host_schema(tmp_path, record, message):
    assert message in _refusal(tmp_path, record)


def test_what_the_cluster_file_itself_uses_is_trusted(tmp_path):
    """The usual departed host (a worker that left, reached like the others) still works."""
    path = tmp_path / "t.yaml"
    path.write_text(CLUSTER)
    (tmp_path / "ssh_config").write_text("")
    _write_state(path, {"node2": _record(ssh={"config": str(tmp_path / "ssh_config"),
                                              "key": "/home/ops/.ssh/id_ed25519"})})
    cluster = load_cluster(path)
    (gone,) = states.load(cluster).departed(cluster)
    assert gone.name == "node2" and gone.ssh.config == str(tmp_path / "ssh_config")
