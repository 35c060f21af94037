"""logs and exec without hosts: selection, the remote script run by a real sh (with stand-ins
for journalctl, uname and tail that print what they were given), parsing and merging by time,
exec's quoting rule and exit codes, and the fabric connection built from SshSettings
(tests/lab/test_logs_exec_lab.py runs both commands against real sshd and journald)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import paramiko
import pytest

from meshdeploy import errors
from meshdeploy.cli import build_parser, main
from meshdeploy.commands.exec_ import command_text, exit_code
from meshdeploy.core.loading import load_cluster
from meshdeploy.core import registry
from meshdeploy.remote import connections as remote
from meshdeploy.remote.ssh_settings import resolve
from meshdeploy.views.log_lines import (
    FOLLOW,
    HostStream,
    SelectionError,
    host_script,
    merge,
    parse,
    select,
    since_value,
)
from meshdeploy.views.logs import Line, render

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lab_cluster():
    return load_cluster(REPO / "inventories" / "lab.yaml")


@pytest.fixture(scope="module")
def sources(lab_cluster):
    return registry.log_sources(lab_cluster)


def names(chosen):
    return [(s.host, s.service) for s in chosen]


# -- which services ---------------------------------------------------------------------------

HOSTS = ["node1", "node2", "node3"]


def test_every_service_in_file_order_by_default(sources):
    assert names(select(sources, HOSTS, [])) == [
        ("node1", "llama-server:main"), ("node2", "rpc-server:50052"),
        ("node3", "rpc-server:50052")]


@pytest.mark.parametrize("words, expected", [
    (["node2"], [("node2", "rpc-server:50052")]),
    (["rpc-server"], [("node2", "rpc-server:50052"), ("node3", "rpc-server:50052")]),
    (["llama-server"], [("node1", "llama-server:main")]),
    (["main"], [("node1", "llama-server:main")]),
    (["meshdeploy-server-main.service"], [("node1", "llama-server:main")]),
    (["meshdeploy-rpc-50052"], [("node2", "rpc-server:50052"), ("node3", "rpc-server:50052")]),
    (["node3:50052"], [("node3", "rpc-server:50052")]),
    (["node3:50052", "main"], [("node1", "llama-server:main"), ("node3", "rpc-server:50052")]),
])
def test_selected_by_host_kind_server_unit_or_host_port(sources, words, expected):
    assert names(select(sources, HOSTS, words)) == expected


def test_a_word_that_names_nothing_is_one_error_listing_what_exists(sources):
    with pytest.raises(SelectionError) as caught:
        select(sources, HOSTS, ["node2", "rpc"])
    assert str(caught.value) == "rpc: no host or service of that name"
    assert "hosts: node1, node2, node3" in caught.value.hint
    for name in ("rpc-server", "llama-server", "main", "node2:50052", "meshdeploy-rpc-50052"):
        assert name in caught.value.hint


def test_a_host_without_services_is_said_so(sources):
    with pytest.raises(SelectionError, match="runs no service"):
        select(sources, HOSTS + ["node4"], ["node4"])


def test_launchd_names_follow_the_services_role(sources):
    rpc = next(s for s in sources if s.host == "node2")
    assert rpc.launchd_log == "/var/log/meshdeploy/com.meshdeploy.rpc-50052.log"
    assert "com.meshdeploy.rpc-50052" in rpc.names


@pytest.mark.parametrize("given, passed", [("10m", "-10m"), ("2h", "-2h"), ("30s", "-30s"),
                                           ("1d", "-1d"), ("2026-11-23", "2026-11-23"),
                                           ("2026-11-23 08:30", "2026-11-23 08:30"),
                                           ("yesterday", "yesterday"), (None, None)])
def test_since(given, passed):
    assert since_value(given) == passed


@pytest.mark.parametrize("bad", ["10", "10 minutes", "-10m", "$(reboot)", "2026-11-23;x"])
def test_since_refuses_anything_else(bad):
    with pytest.raises(errors.MeshdeployError, match="--since"):
        since_value(bad)


# -- the remote script, run by a real sh ------------------------------------------------------

FAKE_JOURNALCTL = """#!/bin/sh
python3 - "$@" <<'EOF'
import json, sys
print(json.dumps({"MESSAGE": json.dumps(sys.argv[1:]), "__REALTIME_TIMESTAMP": "1",
                  "__CURSOR": "c"}))
EOF
case " $* " in *" -f "*) exec sleep 60 ;; esac
"""


def start_script(tmp_path, script, kernel="Linux"):
    """The script under sh in a session of its own (as sshd starts a command), stdin a pipe
    that stays open (the SSH channel) until the test closes it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in {"journalctl": FAKE_JOURNALCTL,
                       "uname": f"#!/bin/sh\necho {kernel}\n",
                       "tail": '#!/bin/sh\nfor a; do echo "tail arg: $a"; done\n'}.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True)


def run_script(tmp_path, script, kernel="Linux"):
    proc = start_script(tmp_path, script, kernel)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def read_until_follower(proc) -> str:
    out = ""
    while True:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        out += line
        if line.startswith("{") and "-f" in journal_args(line)[0]:
            return out


def journal_args(output):
    return [json.loads(json.loads(line)["MESSAGE"]) for line in output.splitlines()
            if line.startswith("{")]


def test_script_reads_each_unit_with_lines_and_since_as_given(tmp_path, sources):
    hostile = "-10m'; touch pwned; '"
    done = run_script(tmp_path, host_script(sources[1:], 5, hostile, follow=False))
    assert done.returncode == 0, done.stderr
    assert [l for l in done.stdout.splitlines() if l.startswith("@")] == [
        "@unit meshdeploy-rpc-50052", "@unit meshdeploy-rpc-50052"]
    assert journal_args(done.stdout)[0] == ["--no-pager", "-o", "json", "-u",
                                            "meshdeploy-rpc-50052", "-n", "5", "--since", hostile]
    assert not (tmp_path / "pwned").exists()


def test_script_without_lines_or_since_passes_neither(tmp_path, sources):
    done = run_script(tmp_path, host_script(sources[:1], None, None, follow=False))
    assert journal_args(done.stdout) == [["--no-pager", "-o", "json", "-u",
                                          "meshdeploy-server-main"]]


def test_script_follows_every_unit_from_when_the_backlog_was_read(tmp_path, sources):
    proc = start_script(tmp_path, host_script(sources, 2, None, follow=True))
    try:
        out = read_until_follower(proc)
        *backlog, follow = journal_args(out)
        assert len(backlog) == 3 and FOLLOW in out.splitlines()
        assert follow[:6] == ["--no-pager", "-o", "json", "-f", "-n", "all"]
        assert follow[6] == "--since" and len(follow[7]) == len("2026-11-23 08:30:01")
        assert follow[8:] == ["-u", "meshdeploy-server-main", "-u", "meshdeploy-rpc-50052",
                              "-u", "meshdeploy-rpc-50052"]
        assert proc.poll() is None  # the follower runs until the channel closes
        proc.stdin.close()  # what sshd does when meshdeploy closes the connection
        proc.wait(timeout=10)
        for _ in range(50):  # the watcher ends itself with the rest: give it a moment
            left = subprocess.run(["pgrep", "-a", "-s", str(proc.pid)], capture_output=True,
                                  text=True).stdout
            if not left:
                break
            time.sleep(0.1)
        assert left == "", f"processes of the script outlived the closed channel: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)


def test_script_on_macos_tails_the_launchd_log_files(tmp_path, sources):
    proc = start_script(tmp_path, host_script(sources[:2], 3, None, follow=True), "Darwin")
    lines = proc.stdout.read().splitlines()  # the stand-in tail -F returns at once
    proc.stdin.close()
    proc.wait(timeout=10)
    assert lines[:2] == ["@launchd", "@unit meshdeploy-server-main"]
    assert "tail arg: /var/log/meshdeploy/com.meshdeploy.server-main.log" in lines
    follow = lines[lines.index("@follow") + 1:]
    assert follow == ["tail arg: -F", "tail arg: -n", "tail arg: 0",
                      "tail arg: /var/log/meshdeploy/com.meshdeploy.server-main.log",
                      "tail arg: /var/log/meshdeploy/com.meshdeploy.rpc-50052.log"]


# -- parsing and merging ----------------------------------------------------------------------

def entry(t, message, unit=None, **fields):
    data = {"__REALTIME_TIMESTAMP": str(t), "MESSAGE": message, "__CURSOR": f"c{t}", **fields}
    if unit:
        data["_SYSTEMD_UNIT"] = unit + ".service"
    return json.dumps(data)


def test_journal_json_becomes_lines_of_the_right_service(sources):
    node1 = HostStream("node1", 0, [sources[0]])
    out = "\n".join(["@unit meshdeploy-server-main",
                     entry(3, "model loaded", "meshdeploy-server-main"),
                     # systemd's own line about the unit: PID 1's, with UNIT=
                     entry(1, "Started x", _SYSTEMD_UNIT="init.scope",
                           UNIT="meshdeploy-server-main.service"),
                     entry(2, [104, 105, 255], "meshdeploy-server-main"),
                     entry(4, "two\nlines\x1b[31m", "meshdeploy-server-main"),
                     "not json", "{broken"])
    lines = parse(node1, out)
    assert [(l.time, l.text) for l in lines] == [(1, "Started x"), (2, "hi\ufffd"),
                                                 (3, "model loaded"), (4, "two"),
                                                 (4, "lines\\x1b[31m")]
    assert {l.service for l in lines} == {"llama-server:main"}


def test_follow_marker_and_launchd_headers(sources):
    mac = HostStream("mac", 0, sources[:2])
    assert mac.feed("@launchd") == [] and mac.feed("@unit meshdeploy-server-main") == []
    assert [l.service for l in mac.feed("loading", now=7)] == ["llama-server:main"]
    assert mac.feed("@follow") == FOLLOW
    assert mac.feed("==> /var/log/meshdeploy/com.meshdeploy.rpc-50052.log <==") == []
    (line,) = mac.feed("accepted", now=9)
    assert (line.time, line.service, line.text) == (9, "rpc-server:50052", "accepted")


def test_hosts_merge_by_time_and_file_order_on_ties():
    a = [Line(1, 0, "node1", "s", "a1"), Line(5, 0, "node1", "s", "a5")]
    b = [Line(2, 1, "node2", "s", "b2"), Line(5, 1, "node2", "s", "b5")]
    c = [Line(1, 2, "node3", "s", "c1")]
    assert [l.text for l in merge([c, b, a])] == ["a1", "c1", "b2", "a5", "b5"]


def test_render_prefixes_host_and_service():
    text = render(Line(1_763_886_601_123_456, 0, "node2", "rpc-server:50052", "hello"), 25)
    prefix, rest = text.split(" | ")
    assert prefix == "node2 rpc-server:50052".ljust(25)
    assert rest.endswith(".123 hello")


# -- exec ---------------------------------------------------------------------------------------

def test_one_word_is_a_shell_snippet_several_are_literal_words(tmp_path):
    env = {**os.environ, "HOME": "/home/x"}

    def run(argv):
        return subprocess.run(["sh", "-c", command_text(argv)], capture_output=True, text=True,
                              env=env, cwd=tmp_path).stdout

    assert run(["echo $HOME | tr x y"]) == "/home/y\n"
    assert run(["printf", "%s\n", "$HOME", "a b", "; touch pwned", "*"]) == \
        "$HOME\na b\n; touch pwned\n*\n"
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(errors.MeshdeployError, match="needs a command"):
        command_text([])


@pytest.mark.parametrize("exits, code", [([0, 0], errors.OK), ([0, 1], errors.ERROR),
                                         ([0, "unreachable"], errors.CONNECT),
                                         ([2, "unreachable"], errors.CONNECT)])
def test_exec_exit_codes(exits, code):
    assert exit_code(exits) == code


def test_cli_takes_words_after_options_and_after_the_double_dash(monkeypatch):
    seen = {}
    monkeypatch.setattr("meshdeploy.commands.logs.run", lambda args: seen.update(logs=args))
    monkeypatch.setattr("meshdeploy.commands.exec_.run", lambda args: seen.update(exec=args))
    main(["logs", "c.yaml", "-n", "5", "node2", "main", "-f"])
    got = seen["logs"]
    assert (got.targets, got.lines, got.follow) == (["node2", "main"], 5, True)
    main(["exec", "c.yaml", "--sudo", "--", "ls", "--sudo", "-l", "--", "x"])
    got = seen["exec"]
    assert (got.argv, got.sudo) == (["ls", "--sudo", "-l", "--", "x"], True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["logs"])


# -- the fabric connection --------------------------------------------------------------------

def test_connection_reads_the_hosts_own_ssh_config_not_the_users(tmp_path):
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Host n1\n    ProxyCommand echo wrong %h\n")
    config = tmp_path / "ssh_config"
    config.write_text("Host n1\n    HostName n1.lab\n    ProxyCommand ip netns exec ns-%h nc "
                      "127.0.0.1 22\n    UserKnownHostsFile " + str(tmp_path / "kh") + "\n")
    cluster = tmp_path / "c.yaml"
    cluster.write_text("cluster: t\nllama_cpp: {ref: b1}\nhosts:\n  n1:\n    address: 10.0.0.1\n"
                       f"    ssh: {{user: deploy, port: 2222, config: {config}, "
                       "key: /k/id, host_key: accept-new}\n")
    settings = resolve(load_cluster(cluster).host("n1"), home=str(home))
    conn = remote.connection(settings)
    assert (conn.host, conn.user, conn.port) == ("n1.lab", "deploy", 2222)
    assert conn.gateway == "ip netns exec ns-n1.lab nc 127.0.0.1 22"
    assert conn.connect_kwargs["key_filename"] == ["/k/id"]
    policy = conn.client._policy
    assert isinstance(policy, remote.AcceptNew) and policy.path == str(tmp_path / "kh")


@pytest.mark.parametrize("policy, kind", [("yes", paramiko.RejectPolicy),
                                          ("no", remote.AcceptAny)])
def test_policy_per_host_key_setting(tmp_path, policy, kind):
    known = tmp_path / "known_hosts"
    key = paramiko.RSAKey.generate(1024)
    known.write_text(f"10.0.0.1 {key.get_name()} {key.get_base64()}\n")
    cluster = tmp_path / "c.yaml"
    cluster.write_text("cluster: t\nllama_cpp: {ref: b1}\nhosts:\n  n1:\n    address: 10.0.0.1\n"
                       f"    ssh: {{host_key: {policy}}}\n")
    home = tmp_path
    (home / ".ssh").mkdir()
    os.replace(known, home / ".ssh" / "known_hosts")
    conn = remote.connection(resolve(load_cluster(cluster).host("n1"), home=str(home)))
    assert isinstance(conn.client._policy, kind)
    # strict hosts check against known_hosts; `no` loads none
    known_key = conn.client._system_host_keys.lookup("10.0.0.1")
    assert (known_key is not None) == (policy == "yes")


def test_accept_new_appends_the_key_to_the_first_known_hosts_file(tmp_path):
    path = tmp_path / "ssh" / "known_hosts"
    key = paramiko.RSAKey.generate(1024)
    client = paramiko.SSHClient()
    remote.AcceptNew(str(path)).missing_host_key(client, "[n1]:2222", key)
    assert path.read_text() == f"[n1]:2222 ssh-rsa {key.get_base64()}\n"
    assert paramiko.HostKeys(str(path)).lookup("[n1]:2222")["ssh-rsa"] == key


def test_an_early_close_is_told_in_words_a_user_can_act_on():
    said = remote.reason(paramiko.SSHException("No existing session"))
    assert said.startswith("the connection closed before SSH started: host down")
    assert remote.reason(OSError("Connection refused\nmore")) == "Connection refused"
