"""network.transport: ssh puts every rpc-server on 127.0.0.1, where every local user reaches it.
What keeps that loopback port its own:

- on a root host the allow-list's output chain drops a connection to it from any local user
  but root, the login user (sshd's forwards run as it) and, where a llama-server of the host
  dials it, systemd's DynamicUser= range (rules.local_ports; loaded for real in a network
  namespace here, and on the lab's nftables by tests/lab/test_rootless_lab.py);
- after every (re)start, the readiness wait of an rpc-server and of a forward checks that each
  listener on the port is the unit's own: its cgroup, the whole path (a squatter that bound the
  port first passed the TCP wait alone: rpc-server exits 0 when it cannot bind);
- a systemd --user unit gets the file-system sandbox a user manager can build (inside a user
  namespace of its own), so a taken-over rpc-server cannot write ~/.ssh/authorized_keys;
- a root worker's sshd refuses Unix-socket forwards to the forwards' logins;
- a HELLO reply's length is bounded before it is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
from pathlib import Path

import pytest
from support import accounts, systemd_parse
from support.require import needs
from support.steps import decided
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.model import RUNIT, SYSTEMD_USER
from meshdeploy.core import account, rpc_hello
from meshdeploy.core.context import HostContext
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.network import facts as nfacts
from meshdeploy.roles.network import operations as network
from meshdeploy.roles.network import rules, ssh_ops
from meshdeploy.roles.services import forward
from meshdeploy.roles.services import operations as services

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"

CLUSTER = """\
cluster: lab
llama_cpp:
  ref: b11312
network:
  transport: ssh
hosts:
  node1:
    address: 10.200.0.11
    rpc_servers:
      - port: {local}
  node2:
    address: 10.200.0.12
    rpc_servers:
      - port: {port}
  node3:
    address: 10.200.0.13
    rootless: true
    rpc_servers:
      - port: {port}
        cache: true
models:
  m: {{path: /m.gguf}}
servers:
  main: {{host: node1, model: m, rpc: ["node1:{local}", "node2:{port}", "node3:{port}"]}}
"""


def ssh_cluster(tmp_path, port: int = 50052, local: int = 50053, manager: str = SYSTEMD_USER):
    """node1 (root) serves main from its own rpc-server and node2's (root) and node3's
    (rootless, under `manager`) through forwards."""
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER.format(port=port, local=local))
    cluster = load_cluster(path)
    layout = account.layout(account.parse("node3", {SYSTEMD_USER: accounts.SYSTEMD_USER,
                                                    RUNIT: accounts.TERMUX}[manager]))
    hosts = tuple(dataclasses.replace(h, layout=layout) if h.name == "node3" else h
                  for h in cluster.hosts)
    return dataclasses.replace(cluster, hosts=hosts)


def rpc_context(cluster, name: str, facts: dict | None = None) -> HostContext:
    host = cluster.host(name)
    key = llama_cpp.build_key(cluster, host, COMMIT)
    base = {"toolchain.Platform": {"kernel": "Linux", "tools": []},
            "llama_cpp.Builds": {"current": key, "builds": {key: {
                "commit": COMMIT, "rpc_binary": "ggml-rpc-server", "flags": []}}},
            "services.Units": {}, **(facts or {})}
    ctx = HostContext(cluster, host, base, run_values(commit=COMMIT, build_number=11312),
                      cluster_facts={name: base})
    return decided(ctx, build_key=key)


# -- root hosts: the output chain -------------------------------------------------------------------

def test_a_root_workers_loopback_port_admits_root_the_login_user_and_a_local_llama_server(tmp_path):
    cluster = ssh_cluster(tmp_path)
    # node2: reached through sshd (the login user) only.
    assert rules.allowlist(cluster, cluster.host("node2"), login_uid=1000) == {
        "loopback/50052": ["uid 0", "uid 1000"]}
    # node1's own llama-server dials its rpc-server directly, as a DynamicUser= of its own.
    node1 = cluster.host("node1")
    assert rules.allowlist(cluster, node1, login_uid=1000)["loopback/50053"] == [
        "uid 0", "uid 1000", "uid 61184-65519"]
    # A login user inside that range is not listed twice (nft refuses overlapping elements).
    assert rules.allowlist(cluster, node1, login_uid=62000)["loopback/50053"] == [
        "uid 0", "uid 61184-65519"]
    # A rootless host has no nftables; the plain transport has no loopback rpc-server.
    assert rules.local_ports(cluster, cluster.host("node3"), 1000) == []
    plain = load_cluster(ROOT / "inventories" / "lab.yaml")
    assert all(rules.local_ports(plain, h, 1000) == [] for h in plain.hosts)


def test_the_allowlist_step_loads_the_chain_and_refuses_an_unknown_login_uid(tmp_path):
    cluster = ssh_cluster(tmp_path)
    facts = {"network.Tools": ["nft"], "network.Allowlist": None,
             "network.SshLogin": {"user": "deploy", "uid": 1001}}
    step = network.allowlist(rpc_context(cluster, "node2", facts))
    joined = "\n".join(step.commands)
    assert step.change.action == "create"
    assert ('tcp dport 50052 oifname "lo" ct state new meta skuid != { 0, 1001 } counter drop'
            in joined)
    facts["network.Allowlist"] = {"loopback/50052": ["uid 0", "uid 1001"]}
    assert network.allowlist(rpc_context(cluster, "node2", facts)).noop
    facts["network.SshLogin"] = {"user": "deploy", "uid": None}
    with pytest.raises(Exception, match="login user's uid was not read"):
        network.allowlist(rpc_context(cluster, "node2", facts))


def _nft(*args: str, text: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "-n", "sh", "-c", *args], input=text, capture_output=True,
                          text=True)


@pytest.mark.system
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a network namespace, nft)")
@needs("nft", "unshare", "setpriv")
def test_the_chain_drops_another_local_user_and_lets_root_and_the_login_user_through(tmp_path):
    """Loaded by nft into a network namespace of its own (its own loopback): nobody's connect
    to the loopback rpc port times out, root's and the login user's connect; without the
    chain nobody got in. What `nft -j list` reads back is the allow-list planned."""
    cluster = ssh_cluster(tmp_path, port=50052)
    nobody = 65534
    login = 1000 if nobody != 1000 else 1001
    text = rules.nft_file(cluster, cluster.host("node2"), login_uid=login)
    (tmp_path / "t.nft").write_text(text)
    listener = ("import socket, time; s = socket.socket(); "
                "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                "s.bind(('127.0.0.1', 50052)); s.listen(16); time.sleep(30)")
    probe = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 50052), 1.5)"
             ".close(); print('open')\nexcept OSError as e:\n    print('closed', e)")
    script = (f'ip link set lo up; python3 -c "{listener}" & pid=$!; '
              'for i in $(seq 100); do python3 -c "$PROBE" | grep -q open && break; '
              'sleep 0.1; done; '
              f"as() {{ setpriv --reuid=$1 --regid=$1 --clear-groups /usr/bin/python3 -c \"$PROBE\"; }}; "
              f'echo "before nobody=$(as {nobody}) login=$(as {login})"; '
              f"nft -f {tmp_path / 't.nft'} || exit 3; "
              f'echo "after nobody=$(as {nobody}) login=$(as {login}) root=$(python3 -c "$PROBE")"; '
              "nft -j list table inet meshdeploy | sed 's/^/json /'; kill $pid")
    proc = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PROBE": probe}, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = {line.split(" ", 1)[0]: line for line in proc.stdout.splitlines()}
    assert "nobody=open" in lines["before"], proc.stdout  # the attack, without the chain
    assert "nobody=closed" in lines["after"] and "login=open" in lines["after"] \
        and "root=open" in lines["after"], proc.stdout
    live = nfacts.Allowlist().process([lines["json"][5:]])
    assert live == rules.allowlist(cluster, cluster.host("node2"), login_uid=login), live


def test_the_fact_reads_back_one_uid_and_lists_hand_made_rules_as_drift():
    def table(right, extra=None, stateless=False):
        rule = {"rule": {"family": "inet", "table": "meshdeploy", "chain": "output", "expr": [
            {"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}},
                       "right": 50052}},
            {"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": "lo"}},
            *([] if stateless else
              [{"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": "new"}}]),
            {"match": {"op": "!=", "left": {"meta": {"key": "skuid"}}, "right": right}},
            {"counter": {"packets": 0, "bytes": 0}}, {"drop": None}]}}
        chain = {"chain": {"family": "inet", "table": "meshdeploy", "name": "output",
                           "type": "filter", "hook": "output", "prio": 0, "policy": "accept"}}
        return json.dumps({"nftables": [chain, rule] + ([extra] if extra else [])})

    assert nfacts.Allowlist().process([table(0)]) == {"loopback/50052": ["uid 0"]}
    assert nfacts.Allowlist().process([table({"set": [0, {"range": [61184, 65519]}, 1000]})]) \
        == {"loopback/50052": ["uid 0", "uid 1000", "uid 61184-65519"]}
    odd = nfacts.Allowlist().process([table("root")])
    assert "loopback/50052" not in odd and odd["other"], odd
    hand = {"rule": {"family": "inet", "table": "meshdeploy", "chain": "output",
                     "expr": [{"accept": None}]}}
    assert nfacts.Allowlist().process([table(0, hand)])["other"]
    # The rule of earlier releases (no `ct state new`) is drift: the plan replaces it.
    assert "loopback/50052" not in nfacts.Allowlist().process([table(0, stateless=True)])


@pytest.mark.system
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a network namespace, nft)")
@needs("nft", "unshare", "setpriv")
def test_the_chain_leaves_replies_from_the_port_alone(tmp_path):
    """A client's ephemeral source port can be the rpc port (while its rpc-server is down):
    the replies of the server it talks to, another user's socket, go to that port. Only new
    connections are dropped; the same chain without `ct state new` dropped those replies."""
    cluster = ssh_cluster(tmp_path, port=50052)
    text = rules.nft_file(cluster, cluster.host("node2"), login_uid=1001)
    assert "ct state new" in text
    (tmp_path / "new.nft").write_text(text)
    (tmp_path / "old.nft").write_text(text.replace("ct state new ", ""))
    listener = ("import socket, time; s = socket.socket(); "
                "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
                "s.bind(('127.0.0.1', 40000)); s.listen(16); time.sleep(20)")
    probe = ("import socket\nc = socket.socket()\nc.setsockopt(socket.SOL_SOCKET, "
             "socket.SO_REUSEADDR, 1)\nc.bind(('127.0.0.1', 50052))\nc.settimeout(1.5)\n"
             "try:\n    c.connect(('127.0.0.1', 40000)); print('open')\n"
             "except OSError as e:\n    print('closed', e)")
    results = {}
    for name in ("old", "new"):
        script = (f"ip link set lo up; nft -f {tmp_path / (name + '.nft')} || exit 3; "
                  f"setpriv --reuid=65534 --regid=65534 --clear-groups /usr/bin/python3 -c "
                  f'"{listener}" & sleep 1; python3 -c "$PROBE"; kill $! 2>/dev/null; true')
        proc = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True,
                              text=True, env={**os.environ, "PROBE": probe}, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        results[name] = proc.stdout.split()[0]
    assert results == {"old": "closed", "new": "open"}, results


# -- the readiness wait: the listener is the unit's own -----------------------------------------

def _stub_ss(tmp_path: Path, lines: list[str]) -> dict:
    """PATH with an `ss` that prints `lines` (and a `systemctl` for --user units)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ss").write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(lines) + "\nEOF\n")
    (bin_dir / "systemctl").write_text(
        "#!/bin/sh\necho /user.slice/user-1000.slice/user@1000.service/app.slice/$6\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _forward_check(tmp_path, lines: list[str]) -> subprocess.CompletedProcess:
    fwd = forward.SshForward(load_cluster(ROOT / "inventories" / "lab.yaml").host("node2"),
                             ((31000, 50052),))
    return subprocess.run(["sh", "-c", forward.owner_check(services.Systemd(),
                                                           "meshdeploy-ssh-node2", "node1/u",
                                                           fwd)],
                          capture_output=True, text=True, env=_stub_ss(tmp_path, lines))


def test_the_forwards_owner_check_matches_the_whole_cgroup_path(tmp_path):
    """A cgroup that only ends like the forward's (another user's scope or unit named so) held
    the port: the old check matched the path's end and accepted it."""
    own = "LISTEN 0 128 127.0.0.1:31000 0.0.0.0:* ino:1 sk:1 cgroup:{} <->"
    ok = _forward_check(tmp_path, [own.format("/system.slice/meshdeploy-ssh-node2.service")])
    assert ok.returncode == 0, ok.stderr
    lookalike = "/user.slice/user-1001.slice/user@1001.service/app.slice/meshdeploy-ssh-node2.service"
    bad = _forward_check(tmp_path, [own.format(lookalike)])
    assert bad.returncode == 1 and f"held by cgroup {lookalike}" in bad.stderr, bad.stderr


def test_a_listener_without_a_cgroup_is_an_error_not_a_warning(tmp_path):
    bare = _forward_check(tmp_path, ["LISTEN 0 128 127.0.0.1:31000 0.0.0.0:* ino:1 sk:1 <->"])
    assert bare.returncode == 1 and "names no cgroup" in bare.stderr, bare.stderr


def test_every_listener_on_the_port_counts(tmp_path):
    """The forward's own listener on 127.0.0.1 and someone else's on 0.0.0.0 (which takes
    connections on the same port too): refused."""
    lines = ["LISTEN 0 128 127.0.0.1:31000 0.0.0.0:* ino:1 sk:1 "
             "cgroup:/system.slice/meshdeploy-ssh-node2.service <->",
             "LISTEN 0 128 0.0.0.0:31000 0.0.0.0:* uid:1001 ino:2 sk:2 "
             "cgroup:/user.slice/user-1001.slice/session-3.scope <->"]
    check = _forward_check(tmp_path, lines)
    assert check.returncode == 1 and "0.0.0.0:31000 is held by cgroup" in check.stderr


def test_a_user_units_check_asks_its_manager_for_the_cgroup(tmp_path):
    cmd = services.port_owner(services.SystemdUser(None), "meshdeploy-rpc-50052", "node3/u",
                              "the rpc-server", [50052])
    line = "LISTEN 0 128 127.0.0.1:50052 0.0.0.0:* uid:1000 ino:1 sk:1 cgroup:{} <->"
    own = "/user.slice/user-1000.slice/user@1000.service/app.slice/meshdeploy-rpc-50052.service"
    ok = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True,
                        env=_stub_ss(tmp_path, [line.format(own)]))
    assert ok.returncode == 0, ok.stderr
    other = "/user.slice/user-1000.slice/session-2.scope"
    bad = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True,
                         env=_stub_ss(tmp_path, [line.format(other)]))
    assert bad.returncode == 1 and "held by cgroup " + other in bad.stderr, bad.stderr
    assert services.port_owner(services.Launchd(), "u", "w", "x", [1]) is None
    # Between two starts (rpc-server exited: it could not bind) the unit has no cgroup: the
    # squatter is named all the same.
    env = _stub_ss(tmp_path, [line.format(other)])
    Path(env["PATH"].split(":")[0], "systemctl").write_text("#!/bin/sh\nexit 0\n")
    idle = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, env=env)
    assert idle.returncode == 1 and (f"127.0.0.1:50052 is held by cgroup {other}, not by the "
                                     "rpc-server (meshdeploy-rpc-50052.service, not running)"
                                     ) in idle.stderr, idle.stderr


def _listener_as_nobody() -> tuple[subprocess.Popen, int]:
    code = ("import socket, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\n"
            "s.listen()\nprint(s.getsockname()[1], flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                             "/usr/bin/python3", "-c", code], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a listener of another uid)")
@needs("ss", "setpriv")
def test_an_rpc_server_port_another_user_took_first_fails_the_step(tmp_path):
    """The rpc_server step's commands after the unit's (re)start, run for real: nobody holds
    the loopback port (the unit could not bind it, and rpc-server exits 0). The TCP wait alone
    accepted that listener (the old step ended there); the owner check refuses it."""
    squatter, port = _listener_as_nobody()
    try:
        cluster = ssh_cluster(tmp_path, port=port, local=port + 1 if port < 65535 else port - 1)
        step = services.rpc_server(rpc_context(cluster, "node2"), port)
        after = step.commands[2:]  # the unit written, then (re)started: then the checks
        assert after and "tcp-wait" in after[0], step.commands
        ran = subprocess.run(["sh", "-c", " && ".join(f"{{ {c}\n}}" for c in after)],
                             capture_output=True, text=True)
        assert ran.returncode != 0, "the squatter passed the rpc-server's readiness"
        assert f"127.0.0.1:{port} is held by cgroup" in ran.stderr, ran.stderr
    finally:
        squatter.kill()


# -- rootless: the user units' sandbox --------------------------------------------------------------

def _user_unit(tmp_path, userns: bool) -> str:
    cluster = ssh_cluster(tmp_path)
    ctx = rpc_context(cluster, "node3", {"services.UserNamespaces": userns})
    step = services.rpc_server(ctx, 50052)
    return "".join(line[1:] + "\n" for line in step.change.unit_diff.splitlines()[3:])


def test_a_user_unit_gets_a_file_system_sandbox_where_user_namespaces_work(tmp_path):
    """Without PrivateUsers=yes a user manager ignores ProtectHome= and the rest silently (shown
    on the lab's systemd 252: ~/.ssh stayed writable); with it, home is read-only but for the
    cache, and the user's runtime folder (its systemd and D-Bus sockets) is out of reach."""
    text = _user_unit(tmp_path, True)
    settings = dict(systemd_parse.settings(text))
    cache = "/home/md/.cache/meshdeploy/meshdeploy-rpc-50052"
    assert settings["PrivateUsers"] == "yes" and settings["ProtectHome"] == "read-only"
    assert settings["ProtectSystem"] == "strict" and settings["PrivateTmp"] == "yes"
    assert settings["ReadWritePaths"] == cache and settings["InaccessiblePaths"] == "%t"
    assert settings["RestrictAddressFamilies"] == "AF_INET AF_INET6"  # no AF_UNIX
    assert "ProtectKernelLogs" not in settings  # fails the start under a user manager
    refused = dict(systemd_parse.settings(_user_unit(tmp_path, False)))
    assert "PrivateUsers" not in refused and "ProtectHome" not in refused
    assert "No file-system sandbox" in _user_unit(tmp_path, False)
    assert refused["RestrictAddressFamilies"] == "AF_INET AF_INET6"  # seccomp: everywhere


@needs("systemd-analyze")
def test_the_sandboxed_user_unit_verifies(tmp_path):
    path = tmp_path / "meshdeploy-rpc-50052.service"
    path.write_text(_user_unit(tmp_path, True))
    done = subprocess.run(["systemd-analyze", "verify", "--user", "--man=no", str(path)],
                          capture_output=True, text=True)
    complaints = [line for line in done.stderr.splitlines()
                  if "Unknown key" in line or "Invalid" in line or "Failed to parse" in line]
    assert not complaints, done.stderr


# -- sshd: Unix-socket forwards --------------------------------------------------------------------

def test_a_root_worker_refuses_unix_socket_forwards_to_the_forwards_logins(tmp_path):
    cluster = ssh_cluster(tmp_path)
    text = ssh_ops.sshd_dropin(cluster, cluster.host("node2"), "deploy")
    assert "Match User deploy Address 10.200.0.11\n\tAllowStreamLocalForwarding no\n" in text
    assert ssh_ops.sshd_file(cluster) == "/etc/ssh/sshd_config.d/00-meshdeploy-lab.conf"
    assert ssh_ops.sshd_dropin(cluster, cluster.host("node1"), "deploy") is None  # no forward


@needs("sshd")  # only sshd -T runs, no daemon
def test_sshd_applies_the_dropin_to_the_forwards_logins_only(tmp_path):
    """sshd -T on a config that includes the drop-in as Debian's does (Include at the top):
    the forward's login from the orchestrator gets no Unix-socket forwarding, the same user
    from elsewhere keeps sshd's default."""
    sshd = shutil.which("sshd")
    if not Path("/run/sshd").is_dir():  # sshd -T wants its privilege separation folder
        if os.geteuid() != 0:
            pytest.skip("no /run/sshd, and no root to make it")
        Path("/run/sshd").mkdir(mode=0o755)
    cluster = ssh_cluster(tmp_path)
    drop = tmp_path / "sshd_config.d"
    drop.mkdir()
    (drop / "00-meshdeploy-lab.conf").write_text(
        ssh_ops.sshd_dropin(cluster, cluster.host("node2"), "deploy"))
    key = tmp_path / "host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    config = tmp_path / "sshd_config"
    # Settings after the Include that are not sshd's defaults: had the drop-in's Match block
    # run on past its file, they would hold only for the matched login, or for nobody.
    config.write_text(f"Include {drop}/*.conf\nHostKey {key}\nAllowStreamLocalForwarding yes\n"
                      "X11Forwarding yes\nPasswordAuthentication no\n")

    def effective(addr: str, user: str = "deploy") -> dict:
        out = subprocess.run([sshd, "-T", "-f", str(config), "-C",
                              f"user={user},host={addr},addr={addr}"],
                             capture_output=True, text=True, check=True).stdout
        wanted = ("allowstreamlocalforwarding", "x11forwarding", "passwordauthentication")
        return {k: v for k, _, v in (line.partition(" ") for line in out.splitlines())
                if k in wanted}

    rest = {"x11forwarding": "yes", "passwordauthentication": "no"}
    assert effective("10.200.0.11") == {"allowstreamlocalforwarding": "no", **rest}
    assert effective("10.200.0.99") == {"allowstreamlocalforwarding": "yes", **rest}
    assert effective("10.200.0.11", "other") == {"allowstreamlocalforwarding": "yes", **rest}


# -- the HELLO reply ---------------------------------------------------------------------------------

class _Endless:
    """A socket whose peer answers HELLO with a length of 2**40 and then streams bytes."""

    def __init__(self):
        self.sent = 0
        self.header = struct.pack("<Q", 2 ** 40)

    def sendall(self, data):
        pass

    def recv(self, n):
        if self.header:
            out, self.header = self.header[:n], self.header[n:]
            return out
        self.sent += min(n, 1 << 16)
        if self.sent > 16 << 20:
            raise AssertionError("read 16 MiB of a HELLO reply")
        return b"\0" * min(n, 1 << 16)


def test_a_hello_reply_length_is_bounded_before_it_is_read():
    """status and bench --sweep run this on the hosts against whatever holds the port: a reply
    claiming 2**40 bytes was read until the memory ran out (here: past 16 MiB)."""
    env: dict = {}
    exec(rpc_hello.FUNCTIONS, env)
    fake = _Endless()
    with pytest.raises(EOFError):
        env["hello"](fake)
    assert fake.sent == 0
    # A real reply (3 bytes) still reads.
    server, client = socket.socketpair()
    try:
        threading.Thread(target=lambda: (server.recv(33),
                                         server.sendall(struct.pack("<Q", 3) + b"\x03\x00\x00")),
                         daemon=True).start()
        assert env["hello"](client) == b"\x03\x00\x00"
    finally:
        server.close()
        client.close()
