"""One connect timeout for every command and both SSH stacks (pyinfra's paramiko connector for
plan, apply and status; fabric for logs, exec and bench): the ssh_config's ConnectTimeout, else
10 s, and --connect-timeout over both; and why a host could not be reached, in the OS's words.

Run for real on loopback: a port nothing listens on (refused), a listener whose accept queue is
full (the kernel drops every SYN: the connect times out, as to a host that went away), and a
ProxyCommand (`nc`) that fails as the lab's `ip netns exec ... nc` does."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshdeploy import errors
from meshdeploy.core.loading import load_cluster
from meshdeploy.remote import connections, reasons
from meshdeploy.remote.session import Session
from meshdeploy.remote.ssh_settings import CONNECT_TIMEOUT_ENV, resolve

ROOT = Path(__file__).resolve().parents[2]
LAB_CONFIG = "/var/lib/meshdeploy/lab/mdlab/ssh_config"


@pytest.fixture
def ports():
    """(a port whose accept queue is full, a port nothing listens on)."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    port = full.getsockname()[1]
    waiting = socket.create_connection(("127.0.0.1", port))  # fills the queue
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed = free.getsockname()[1]
    free.close()
    yield port, closed
    waiting.close()
    full.close()


def cluster_file(tmp_path: Path, full: int, closed: int, timeout: str = "1",
                 node1_by: str = "tcp") -> Path:
    """inventories/lab.yaml with node1 dialled at the full port (`node1_by` "proxy": through a
    ProxyCommand that hangs there, as the lab's into a namespace whose port 22 drops), node2 at
    the closed one, and node3 through a ProxyCommand that cannot connect; ConnectTimeout
    `timeout` for all."""
    if not Path("/usr/bin/nc").exists() and not Path("/bin/nc").exists():
        pytest.skip("needs nc (the lab's ProxyCommand)")
    config = tmp_path / "ssh_config"
    node1 = (f"    ProxyCommand nc 127.0.0.1 {full}\n" if node1_by == "proxy"
             else "    HostName 127.0.0.1\n")
    config.write_text(f"Host node1\n{node1}    ConnectTimeout {timeout}\n"
                      f"Host node2\n    HostName 127.0.0.1\n    ConnectTimeout {timeout}\n"
                      f"Host node3\n    ProxyCommand nc -v 127.0.0.1 {closed}\n"
                      f"    ConnectTimeout {timeout}\n")
    text = (ROOT / "inventories" / "lab.yaml").read_text().replace(LAB_CONFIG, str(config))
    lines = text.splitlines(keepends=True)
    for host, port in (("node1", full), ("node2", closed)):
        at = lines.index(f"  {host}:\n") + 2
        assert lines[at].startswith("    ssh: {user: deploy,")
        lines[at] = lines[at].replace("{user: deploy,", f"{{port: {port}, user: deploy,")
    path = tmp_path / "lab.yaml"
    path.write_text("".join(lines))
    return path


EXPECTED = {"node1": "timed out", "node2": "connection refused",
            "node3": "connection refused (ProxyCommand: "}


def assert_reasons(found: dict) -> None:
    assert set(found) == set(EXPECTED), found
    for host, said in EXPECTED.items():
        assert found[host].startswith(said), (host, found[host])
        assert "No existing session" not in found[host]


def test_settings_take_the_ssh_config_then_the_flag(tmp_path, monkeypatch, ports):
    monkeypatch.delenv(CONNECT_TIMEOUT_ENV, raising=False)
    cluster = load_cluster(cluster_file(tmp_path, *ports, timeout="7"))
    s = resolve(cluster.host("node1"))
    assert (s.connect_timeout, s.connect_timeout_from) == (7.0, f"ConnectTimeout in "
                                                                f"{tmp_path / 'ssh_config'}")
    # pyinfra applies these after its own fixed CONNECT_TIMEOUT (10); fabric gets the same.
    assert s.pyinfra_data()["ssh_paramiko_connect_kwargs"] == {"timeout": 7.0,
                                                               "banner_timeout": 7.0}
    conn = connections.connection(s)
    assert conn.connect_timeout == 7.0 and conn.connect_kwargs["banner_timeout"] == 7.0
    monkeypatch.setenv(CONNECT_TIMEOUT_ENV, "2.5")
    s = resolve(cluster.host("node1"))
    assert (s.connect_timeout, s.connect_timeout_from) == (2.5, "--connect-timeout")
    monkeypatch.setenv(CONNECT_TIMEOUT_ENV, "soon")
    with pytest.raises(errors.PlanError, match="not a number of seconds"):
        resolve(cluster.host("node1"))


def test_without_either_the_default_is_ten_seconds(tmp_path, monkeypatch):
    monkeypatch.delenv(CONNECT_TIMEOUT_ENV, raising=False)
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    s = resolve(cluster.host("node1"), home=str(tmp_path))
    assert (s.connect_timeout, s.connect_timeout_from) == (10, "the default")


@pytest.mark.parametrize("node1_by", ["tcp", "proxy"])
def test_pyinfra_waits_the_ssh_configs_timeout_and_says_why(tmp_path, monkeypatch, ports,
                                                            node1_by):
    """plan, apply and status: pyinfra's connector used to wait its fixed 10 s whatever the
    ssh_config said, and said "Could not connect ([Errno None] Unable to connect to port ...)"
    or, behind a ProxyCommand, "... returned nonzero exit status: Broken pipe"."""
    monkeypatch.delenv(CONNECT_TIMEOUT_ENV, raising=False)
    session = Session(load_cluster(cluster_file(tmp_path, *ports, node1_by=node1_by)))
    session.open()
    started = time.monotonic()
    try:
        session.connect(tolerate=True)
    finally:
        session.close()
    seconds = time.monotonic() - started
    assert_reasons(session.unreachable)
    assert seconds < 6, f"{seconds:.1f} s: the 1 s ConnectTimeout was not honoured"


def test_without_tolerate_every_failure_is_one_error(tmp_path, monkeypatch, ports):
    monkeypatch.setenv(CONNECT_TIMEOUT_ENV, "1")
    session = Session(load_cluster(cluster_file(tmp_path, *ports, timeout="30")))
    session.open()
    try:
        with pytest.raises(errors.ConnectError) as raised:
            session.connect()
    finally:
        session.close()
    assert re.search(r"node1: timed out; node2: connection refused; node3: connection "
                     r"refused \(ProxyCommand: ", raised.value.message), raised.value.message


@pytest.mark.parametrize("node1_by", ["tcp", "proxy"])
def test_fabric_waits_the_same_and_says_the_same(tmp_path, monkeypatch, ports, node1_by):
    """logs, exec and bench (fabric) report in the same words, within the same timeout (a
    banner that times out in paramiko's transport thread reached fabric as "No existing
    session")."""
    monkeypatch.setenv(CONNECT_TIMEOUT_ENV, "1")  # over the file's 30 s, as the flag does
    cluster = load_cluster(cluster_file(tmp_path, *ports, timeout="30", node1_by=node1_by))
    started = time.monotonic()
    hosts = connections.connect([resolve(h) for h in cluster.hosts])
    seconds = time.monotonic() - started
    hosts.close()
    assert not hosts.connections
    assert_reasons(hosts.unreachable)
    assert seconds < 6, f"{seconds:.1f} s: --connect-timeout 1 was not honoured"


def test_status_reports_every_host_away_as_a_row_and_exits_down(tmp_path, ports):
    """The flag, given on the command line, reaches every host; each host away is a row
    `unreachable: WHY`, and with the server's own host away the verdict is down."""
    path = cluster_file(tmp_path, *ports, timeout="30")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "meshdeploy", "status", str(path), "--json",
                           "--connect-timeout", "1"], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    seconds = time.monotonic() - started
    assert done.returncode == errors.DOWN, done.stdout + done.stderr
    rows = json.loads(done.stdout)
    assert_reasons({r["host"]: r["answer"].removeprefix("unreachable: ") for r in rows})
    assert all(r["reachable"] is False and not r["healthy"] for r in rows)
    assert seconds < 20, seconds
    # --limit: only the hosts named are asked.
    done = subprocess.run([sys.executable, "-m", "meshdeploy", "status", str(path),
                           "--limit", "node2", "--connect-timeout", "1"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == errors.DEGRADED, done.stdout + done.stderr
    assert "node2" in done.stdout and "node1" not in done.stdout.replace("node2", "")


def test_a_reason_is_the_oss_words_also_when_a_library_wraps_them():
    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except OSError as exc:
            raise RuntimeError("Could not connect ([Errno 111] Connection refused)") from exc
    except RuntimeError as wrapped:
        assert reasons.reason(wrapped) == "connection refused"
    assert reasons.reason(socket.timeout("timed out")) == "timed out"
    import paramiko

    said = reasons.reason(paramiko.SSHException("No existing session"))
    assert said.startswith("the connection closed before SSH started")
    assert reasons.reason(paramiko.SSHException("No existing session"),
                          "ssh: connect to host 10.0.0.5 port 22: No route to host\n") == \
        "no route to host (ProxyCommand: ssh: connect to host 10.0.0.5 port 22: No route to host)"


def test_a_plan_names_a_host_away_and_what_it_means_for_the_servers():
    from meshdeploy.remote.session import away_warning

    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    assert away_warning(cluster, "node3", "timed out") == (
        "node3 could not be reached (timed out): this plan leaves it out, as --limit would, and "
        "changes nothing there; llama-server main on node1 uses its rpc-server: while node3 is "
        "away main serves only on a placement without node3, if it has one, else it is down")
    assert away_warning(cluster, "node1", "connection refused").endswith(
        "; llama-server main runs there and is not planned")


def test_a_plan_with_every_host_away_is_one_error(tmp_path, monkeypatch, ports):
    """Nothing to plan: the old single error, not an empty plan of every host."""
    monkeypatch.setenv(CONNECT_TIMEOUT_ENV, "1")
    done = subprocess.run([sys.executable, "-m", "meshdeploy", "plan",
                           str(cluster_file(tmp_path, *ports))], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == errors.CONNECT, done.stdout + done.stderr
    assert done.stderr.startswith("cannot connect over SSH to node1: timed out; node2: "
                                  "connection refused; node3: connection refused"), done.stderr
    assert "Traceback" not in done.stderr
