"""A host with `connection: local` is the machine meshdeploy runs on: the cluster file's checks,
the pyinfra inventory (the @local connector under the host's own name), the settings every
client takes, and the local runner of logs, exec and bench, run for real on this machine
(nothing here changes it: commands are `echo`, `id`, `sleep`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from meshdeploy.cli import main
from meshdeploy.core.loading import load_cluster
from meshdeploy.engine import state as states
from meshdeploy.errors import ConfigError, PlanError
from meshdeploy.remote import connections as remote
from meshdeploy.remote.session import Session
from meshdeploy.remote.ssh_settings import LOCAL, no_check_warnings, resolve

ROOT = Path(__file__).resolve().parents[2]

HEAD = "cluster: t\nllama_cpp: {ref: b11312}\n"
TWO_HOSTS = HEAD + """hosts:
  node1:
    address: 10.0.0.11
    connection: local
  node2:
    address: 10.0.0.12
    ssh: {user: deploy, port: 2222}
    rpc_servers: [{port: 50052}]
models:
  m: {path: /models/m.gguf}
servers:
  main: {host: node1, model: m}
"""
ONLY_LOCAL = HEAD + "hosts:\n  here:\n    address: 127.0.0.1\n    connection: local\n"


def write(tmp_path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- the cluster file ------------------------------------------------------------------------

def test_connection_defaults_to_ssh_and_local_is_kept(tmp_path):
    cluster = load_cluster(write(tmp_path, TWO_HOSTS))
    assert [(h.name, h.connection, h.local) for h in cluster.hosts] == \
        [("node1", "local", True), ("node2", "ssh", False)]


def test_ssh_settings_on_a_local_host_are_an_error_at_their_line(tmp_path):
    text = TWO_HOSTS.replace("    connection: local\n",
                             "    connection: local\n    ssh: {user: deploy, sudo: false}\n")
    with pytest.raises(ConfigError) as caught:
        load_cluster(write(tmp_path, text))
    (issue,) = caught.value.issues
    assert (issue.line, issue.col, issue.path) == (7, 5, "hosts.node1.ssh")
    assert "connection: local" in issue.message and "remove the ssh block" in issue.hint


def test_two_local_hosts_are_an_error_at_the_second(tmp_path):
    text = TWO_HOSTS.replace("    ssh: {user: deploy, port: 2222}\n", "    connection: local\n")
    with pytest.raises(ConfigError) as caught:
        load_cluster(write(tmp_path, text))
    (issue,) = caught.value.issues
    assert (issue.line, issue.path) == (9, "hosts.node2.connection")
    assert "node1 already is" in issue.message


def test_an_unknown_connection_is_a_schema_error_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_cluster(write(tmp_path, TWO_HOSTS.replace("connection: local", "connection: lokal")))
    (issue,) = caught.value.issues
    assert issue.path == "hosts.node1.connection" and "'local'" in issue.hint


def test_the_example_mac_inventory_runs_on_the_mac_itself():
    cluster = load_cluster(ROOT / "inventories" / "one-mac-mtl0-cpu.yaml")
    assert cluster.host("mac").local


# -- sudo and the settings every client takes ------------------------------------------------

@pytest.mark.parametrize("euid, sudo", [(0, False), (1000, True)])
def test_a_local_host_uses_sudo_unless_meshdeploy_runs_as_root(tmp_path, monkeypatch, euid, sudo):
    cluster = load_cluster(write(tmp_path, TWO_HOSTS))
    monkeypatch.setattr("meshdeploy.config.model.os.geteuid", lambda: euid)
    assert cluster.host("node1").sudo is sudo
    assert cluster.host("node2").sudo is True  # ssh.sudo, whoever runs meshdeploy
    settings = resolve(cluster.host("node1"))
    assert settings.sudo is sudo and settings.pyinfra_data() == {"_sudo": sudo}


def test_nothing_of_ssh_applies_to_a_local_host(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    # The user's ssh_config has an entry of the host's name that turns checks off: over SSH
    # it would be warned about; the local host is not reached through it at all.
    (home / ".ssh" / "config").write_text("Host node1 10.0.0.11\n    StrictHostKeyChecking no\n"
                                          "    ProxyCommand false\n")
    cluster = load_cluster(write(tmp_path, TWO_HOSTS))
    settings = resolve(cluster.host("node1"), accept_new=True, home=str(home))
    assert settings.local and settings.host_key == LOCAL
    assert (settings.user, settings.key, settings.config, settings.proxy_command) == \
        (None, None, None, None)
    assert no_check_warnings([settings]) == []
    over_ssh = resolve(load_cluster(write(tmp_path, TWO_HOSTS.replace(
        "    connection: local\n", ""), "ssh.yaml")).host("node1"), home=str(home))
    assert not over_ssh.local and no_check_warnings([over_ssh]) != []


# -- the pyinfra inventory -------------------------------------------------------------------

def test_the_inventory_gives_the_local_host_pyinfras_local_connector_under_its_own_name(
        tmp_path):
    from pyinfra.connectors.local import LocalConnector
    from pyinfra.connectors.ssh import SSHConnector

    session = Session(load_cluster(write(tmp_path, TWO_HOSTS)))
    session.open()
    try:
        node1, node2 = session.pyhosts["node1"], session.pyhosts["node2"]
        assert (node1.name, type(node1.connector)) == ("node1", LocalConnector)
        assert (node2.name, type(node2.connector)) == ("node2", SSHConnector)
        assert node2.data.ssh_hostname == "10.0.0.12" and node2.data.ssh_port == 2222
        assert node1.data.get("ssh_hostname") is None  # no SSH target at all
    finally:
        session.close()


def test_pyinfra_runs_the_local_hosts_commands_here(tmp_path):
    session = Session(load_cluster(write(tmp_path, ONLY_LOCAL)))
    session.open()
    session.connect()
    try:
        ok, output = session.run("here", "echo meshdeploy-$((6*7)); id -u")
        assert ok and output.stdout_lines == ["meshdeploy-42", str(os.geteuid())]
        ok, output = session.run("here", "exit 3")
        assert not ok
        assert session.commands_run == {"here": 2}
        sample = tmp_path / "header.bin"
        sample.write_bytes(b"GGUF\x03\x00")
        assert session.read_remote("here", str(sample), lambda f, where: (f.read(4), where)) == \
            (b"GGUF", f"here:{sample}")
        with pytest.raises(ValueError, match="here:/nonexistent/x: No such file"):
            session.read_remote("here", "/nonexistent/x", lambda f, where: f.read())
    finally:
        session.close()


def test_a_departed_local_host_beside_the_files_local_host_is_refused(tmp_path):
    path = write(tmp_path, TWO_HOSTS)
    cluster = load_cluster(path)
    state = states.load(cluster)
    old = load_cluster(write(tmp_path, TWO_HOSTS.replace("node1", "node0"), "old.yaml"))
    state.hosts["node0"] = states.record_for(old, old.host("node0"))
    states.save(state)
    recorded = json.loads(states.state_path(path).read_text())["hosts"]["node0"]
    assert recorded["connection"] == "local"
    # The state alone cannot make a departed host local (docs/security.md, "The state file") ...
    with pytest.raises(ConfigError, match="hosts.node0.connection: node0 left the cluster file"):
        states.load(cluster)
    # ... and a session refuses a second local host wherever it comes from.
    departed = [state.hosts["node0"].host("/opt/meshdeploy")]
    assert [(h.name, h.local) for h in departed] == [("node0", True)]
    with pytest.raises(PlanError, match="node1 and node0 are all this machine"):
        Session(cluster, departed=departed).open()


# -- logs, exec and bench: invoke's local runner ---------------------------------------------

def local_connection(tmp_path):
    return remote.connection(resolve(load_cluster(write(tmp_path, ONLY_LOCAL)).host("here")))


def test_the_local_connection_runs_commands_with_fabrics_result(tmp_path):
    conn = local_connection(tmp_path)
    assert isinstance(conn, remote.LocalConnection)
    hosts = remote.connect([conn.settings])
    assert list(hosts.connections) == ["here"] and hosts.unreachable == {}
    result = conn.run("echo out; echo err >&2; exit 5", warn=True, hide=True, in_stream=False)
    assert (result.exited, result.stdout, result.stderr) == (5, "out\n", "err\n")
    assert conn.seconds > 0


def test_a_local_command_runs_in_its_own_session(tmp_path):
    conn = local_connection(tmp_path)
    result = conn.run("ps -o sid= -p $$", hide=True, in_stream=False)
    assert int(result.stdout) != os.getsid(0)


# A host script that ends its own processes (`kill 0`, as logs -f does when its input closes)
# run by a child Python through invoke's stock runner, then through LocalConnection.
_KILL0 = """
import sys
from meshdeploy.remote import connections as remote
from meshdeploy.remote.ssh_settings import SshSettings
if sys.argv[1] == "stock":
    import invoke
    invoke.run("kill 0", hide=True, warn=True, in_stream=False)
else:
    settings = SshSettings("here", "localhost", 22, None, None, None, False, "", "", (),
                           "localhost", None, local=True)
    remote.LocalConnection(settings).run("kill 0", hide=True, warn=True, in_stream=False)
print("survived")
"""


@pytest.mark.parametrize("runner, survives", [("stock", False), ("meshdeploy", True)])
def test_kill_0_in_a_local_command_never_reaches_meshdeploy(runner, survives):
    child = subprocess.run([sys.executable, "-c", _KILL0, runner], capture_output=True,
                           text=True, start_new_session=True)
    if survives:
        assert (child.returncode, child.stdout) == (0, "survived\n"), child.stderr
    else:  # the hazard is real: the stock runner shares meshdeploy's process group
        assert child.returncode == -signal.SIGTERM


# bench runs with the standard library patched for gevent (as plan and apply): its subprocess
# pipes are non-blocking there, where invoke's own reader raised BlockingIOError.
_PATCHED = """
from gevent import monkey
monkey.patch_all()
from meshdeploy.remote import connections as remote
from meshdeploy.remote.ssh_settings import SshSettings
settings = SshSettings("here", "localhost", 22, None, None, None, False, "", "", (),
                       "localhost", None, local=True)
result = remote.LocalConnection(settings).run(
    "sleep 0.2; echo err >&2; head -c 300000 /dev/zero | tr '\\\\0' x",
    hide=True, warn=True, in_stream=False)
print(result.exited, len(result.stdout), result.stderr.strip(), set(result.stdout))
"""


def test_the_local_runner_works_where_gevent_patched_the_standard_library():
    child = subprocess.run([sys.executable, "-c", _PATCHED], capture_output=True, text=True)
    assert child.stdout == "0 300000 err {'x'}\n", child.stderr[-2000:]


def test_close_ends_a_command_that_waits_for_its_input_to_close(tmp_path):
    conn = local_connection(tmp_path)
    # As logs -f: a watcher ends the script's processes once the input closes.
    script = "exec 3<&0; { cat <&3 >/dev/null 2>&1; kill 0; } & echo started; sleep 600"
    seen = []
    worker = threading.Thread(target=lambda: seen.append(
        conn.run(script, warn=True, hide=True, in_stream=False)), daemon=True)
    worker.start()
    while not conn.processes:
        threading.Event().wait(0.05)
    conn.close()
    worker.join(120)
    assert seen and seen[0].stdout == "started\n"
    assert conn.processes[0].poll() is not None


def test_dial_reaches_a_listener_of_this_machine(tmp_path):
    conn = local_connection(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with conn.dial("127.0.0.1", port, timeout=30) as sock:
            peer, _ = server.accept()
            with peer:
                sock.sendall(b"ping")
                assert peer.recv(4) == b"ping"


def test_exec_on_the_local_host(tmp_path, capsys):
    path = write(tmp_path, ONLY_LOCAL)
    assert main(["exec", str(path), "--", "echo $((6*7)) from $(id -u)"]) == 0
    out = capsys.readouterr().out
    assert "== here (exit 0," in out and f"42 from {os.geteuid()}" in out
    assert main(["exec", str(path), "--", "exit 4"]) == 1
    assert re.search(r"^here +4 ", capsys.readouterr().out, re.M)


@pytest.mark.skipif(os.geteuid() != 0, reason="meshdeploy as root")
def test_exec_sudo_on_the_local_host_as_root_needs_no_sudo(tmp_path, capsys):
    # This machine may have no sudo at all: through `sudo -n` the command would not run.
    assert main(["exec", str(write(tmp_path, ONLY_LOCAL)), "--sudo", "--", "id -u"]) == 0
    assert "== here (exit 0," in capsys.readouterr().out
