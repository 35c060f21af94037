"""A host's connection settings and host-key policy: cluster file, ssh_config, flag, default;
and how a refused key is told (tests/lab/test_host_keys.py refuses real keys from real sshd)."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import paramiko
import pytest

from meshdeploy import errors
from meshdeploy.core.loading import load_cluster
from meshdeploy.remote.host_keys import HostKeyError, classify, host_key_error
from meshdeploy.remote.ssh_settings import no_check_warnings, resolve


def cluster_file(tmp_path: Path, ssh: str = "{}", port: int = 22) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text("cluster: t\nllama_cpp: {ref: b1}\nhosts:\n"
                    f"  n1: {{address: 10.0.0.1, ssh: {ssh}}}\n"
                    f"  n2: {{address: 10.0.0.2, ssh: {{port: {port}}}}}\n")
    return path


def settings(tmp_path, ssh="{}", accept_new=False, home=None, host="n1"):
    cluster = load_cluster(cluster_file(tmp_path, ssh))
    return resolve(cluster.host(host), accept_new=accept_new, home=str(home or tmp_path))


def write_config(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


# -- where the policy comes from -------------------------------------------------------------

def test_default_is_strict_with_the_users_known_hosts(tmp_path):
    s = settings(tmp_path)
    assert (s.host_key, s.host_key_from) == ("yes", "the default")
    assert s.known_hosts == (str(tmp_path / ".ssh" / "known_hosts"),)
    assert s.config is None and s.target == "10.0.0.1"
    assert s.pyinfra_data()["ssh_strict_host_key_checking"] == "yes"


def test_cluster_file_sets_it_per_host(tmp_path):
    s = settings(tmp_path, "{host_key: accept-new}")
    assert (s.host_key, s.host_key_from) == ("accept-new", "hosts.n1.ssh.host_key")
    assert settings(tmp_path, "{host_key: accept-new}", host="n2").host_key == "yes"


@pytest.mark.parametrize("written, policy", [("yes", "yes"), ("accept-new", "accept-new"),
                                             ("no", "no"), ("off", "no"), ("ask", "yes"),
                                             ("Accept-New", "accept-new")])
def test_users_ssh_config_is_honoured_when_the_file_says_nothing(tmp_path, written, policy):
    config = write_config(tmp_path / ".ssh" / "config",
                          f"Host 10.0.0.1\n    StrictHostKeyChecking {written}\n"
                          "    UserKnownHostsFile ~/kh/one /etc/kh/two\n")
    s = settings(tmp_path)
    assert s.host_key == policy
    assert s.host_key_from == f"StrictHostKeyChecking {written.lower()} in {config}"
    assert s.known_hosts == (str(tmp_path / "kh" / "one"), "/etc/kh/two")
    # The other host has no entry: the default, and ~/.ssh/known_hosts.
    other = settings(tmp_path, host="n2")
    assert other.host_key == "yes" and other.known_hosts[0].endswith(".ssh/known_hosts")


def test_an_ssh_config_changed_between_two_reads_is_read_again(tmp_path):
    """The file is parsed once while it stays as it was (hosts of a fleet share one); a change
    of its contents is seen by the next read in the same process."""
    config = write_config(tmp_path / ".ssh" / "config",
                          "Host 10.0.0.1\n    StrictHostKeyChecking no\n")
    assert settings(tmp_path).host_key == "no"
    assert settings(tmp_path).host_key == "no"
    write_config(config, "Host 10.0.0.1\n    StrictHostKeyChecking accept-new\n")
    assert settings(tmp_path).host_key == "accept-new"


def test_clusters_ssh_config_replaces_the_users(tmp_path):
    write_config(tmp_path / ".ssh" / "config", "Host *\n    StrictHostKeyChecking no\n")
    own = write_config(tmp_path / "lab" / "ssh_config",
                       "Host n1\n    HostName n1.lab\n    ProxyCommand nc %h 22\n"
                       "    StrictHostKeyChecking accept-new\n")
    s = settings(tmp_path, f"{{config: {own}}}")
    assert s.config == str(own) and s.target == "n1" and s.hostname == "n1.lab"
    assert (s.host_key, s.host_key_from) == ("accept-new",
                                             f"StrictHostKeyChecking accept-new in {own}")
    assert s.proxy_command == "nc n1.lab 22"
    assert s.pyinfra_data()["ssh_config_file"] == str(own)


def test_cluster_file_wins_over_ssh_config(tmp_path):
    write_config(tmp_path / ".ssh" / "config", "Host *\n    StrictHostKeyChecking no\n")
    assert settings(tmp_path, "{host_key: 'yes'}").host_key == "yes"
    assert settings(tmp_path).host_key == "no"


def test_flag_turns_strict_into_accept_new_and_leaves_no_alone(tmp_path):
    s = settings(tmp_path, accept_new=True)
    assert (s.host_key, s.host_key_from) == ("accept-new", "--accept-new-host-keys")
    assert settings(tmp_path, "{host_key: 'yes'}", accept_new=True).host_key == "accept-new"
    assert settings(tmp_path, "{host_key: 'no'}", accept_new=True).host_key == "no"


def test_a_folder_where_the_ssh_config_should_be_is_no_config(tmp_path):
    (tmp_path / ".ssh" / "config").mkdir(parents=True)
    assert settings(tmp_path).config is None
    s = settings(tmp_path, f"{{config: {tmp_path / '.ssh' / 'config'}}}")
    assert (s.host_key, s.target) == ("yes", "10.0.0.1")


def test_known_hosts_name_carries_a_non_default_port(tmp_path):
    cluster = load_cluster(cluster_file(tmp_path, port=2222))
    s = resolve(cluster.host("n2"), home=str(tmp_path))
    assert s.known_hosts_name == "[10.0.0.2]:2222"
    assert resolve(cluster.host("n1"), home=str(tmp_path)).known_hosts_name == "10.0.0.1"


def test_no_is_warned_once_per_source_naming_hosts(tmp_path):
    write_config(tmp_path / ".ssh" / "config", "Host *\n    StrictHostKeyChecking no\n")
    cluster = load_cluster(cluster_file(tmp_path))
    got = no_check_warnings([resolve(h, home=str(tmp_path)) for h in cluster.hosts])
    assert len(got) == 1
    assert got[0].startswith("host keys are not checked for n1, n2 (StrictHostKeyChecking no in")
    assert no_check_warnings([settings(tmp_path, "{host_key: accept-new}")]) == []


# -- telling a refused key -------------------------------------------------------------------

@pytest.fixture(scope="module")
def keys():
    return paramiko.ECDSAKey.generate(), paramiko.ECDSAKey.generate()


def openssh_fingerprint(key) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode() \
        .rstrip("=")


def known(tmp_path: Path, name: str, key) -> None:
    path = tmp_path / ".ssh" / "known_hosts"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"{name} {key.get_name()} {key.get_base64()}\n")


def test_unknown_key_names_fingerprint_and_the_choice(tmp_path, keys):
    s = settings(tmp_path)
    error = host_key_error({"n1": (s, keys[0], "SSH error (StrictPolicy: ...)")})
    assert isinstance(error, HostKeyError) and error.exit_code == errors.CONNECT
    fp = openssh_fingerprint(keys[0])
    assert str(error).startswith(f"host key of n1 is unknown: 10.0.0.1 offered "
                                 f"ecdsa-sha2-nistp256 key {fp}, not in ")
    assert "--accept-new-host-keys" in error.hint
    assert "hosts.n1.ssh.host_key: accept-new" in error.hint
    assert "ssh-keygen -lf /etc/ssh/ssh_host_ecdsa_key.pub" in error.hint


def test_changed_key_names_fingerprint_and_the_fix(tmp_path, keys):
    known(tmp_path, "10.0.0.1", keys[0])
    s = settings(tmp_path, "{host_key: accept-new}")
    assert classify(s, keys[0]) is None  # the known key: not a key problem
    error = host_key_error({"n1": (s, keys[1], "SSH host key error (...)"),
                            "n2": (settings(tmp_path, host="n2"), None, "Could not connect")})
    assert str(error).startswith(
        f"host key of n1 changed: 10.0.0.1 offered ecdsa-sha2-nistp256 key "
        f"{openssh_fingerprint(keys[1])}, but {tmp_path}/.ssh/known_hosts holds another key")
    assert str(error).endswith("nothing was changed on any host; also failed to connect: "
                               "n2: Could not connect")
    assert f"ssh-keygen -R 10.0.0.1 -f {tmp_path}/.ssh/known_hosts" in error.hint


def test_changed_key_on_another_port_quotes_the_entry(tmp_path, keys):
    known(tmp_path, "[10.0.0.2]:2222", keys[0])
    cluster = load_cluster(cluster_file(tmp_path, port=2222))
    s = resolve(cluster.host("n2"), home=str(tmp_path))
    error = host_key_error({"n2": (s, keys[1], "SSH host key error")})
    assert "ssh-keygen -R '[10.0.0.2]:2222'" in error.hint


def test_other_failures_are_not_host_key_errors(tmp_path, keys):
    known(tmp_path, "10.0.0.1", keys[0])
    s = settings(tmp_path)
    assert host_key_error({"n1": (s, keys[0], "Authentication error")}) is None
    assert host_key_error({"n1": (s, None, "Could not connect")}) is None
    # accept-new and nothing known: the key was accepted, so it is not why it failed.
    (tmp_path / "other").mkdir()
    fresh = settings(tmp_path / "other", "{host_key: accept-new}")
    assert host_key_error({"n1": (fresh, keys[1], "Authentication error")}) is None


# In a child process: plan, apply and status patch the standard library with gevent.
FLAG_PROBE = """
import sys
from meshdeploy import cli
from meshdeploy.remote.session import Session
def open_session(self):
    print("accept_new_host_keys", self.accept_new_host_keys)
    raise SystemExit(0)
Session.open = open_session
cli.main(sys.argv[1:])
"""


@pytest.mark.parametrize("command", ["plan", "apply", "status"])
def test_the_flag_reaches_the_session(command, tmp_path):
    import subprocess
    import sys

    path = cluster_file(tmp_path)
    for flags, want in (([], "False"), (["--accept-new-host-keys"], "True")):
        done = subprocess.run([sys.executable, "-c", FLAG_PROBE, command, *flags, str(path)],
                              capture_output=True, text=True, timeout=60)
        assert done.stdout.split() == ["accept_new_host_keys", want], done.stderr


def test_session_warns_about_hosts_without_checks(tmp_path):
    from meshdeploy.remote.session import Session

    write_config(tmp_path / "ssh_config", "Host n2\n    StrictHostKeyChecking no\n")
    ssh = f"{{host_key: 'no', config: {tmp_path}/ssh_config}}"
    cluster = load_cluster(cluster_file(tmp_path, ssh))
    session = Session(cluster)
    session.settings = {h.name: resolve(h, home=str(tmp_path)) for h in cluster.hosts}
    assert session.warnings() == [
        "host keys are not checked for n1 (hosts.n1.ssh.host_key): anyone on the path can "
        "impersonate the host and read what meshdeploy sends. Use yes or accept-new."]
