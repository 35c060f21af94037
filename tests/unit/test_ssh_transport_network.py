"""network's part of network.transport: ssh: the orchestrators' key pairs, the workers'
authorized lines and the pinned known_hosts.

The scripts run for real here as a user without root (support.nonroot): the authorized_keys
write against a temporary HOME (a link planted at the file shown writing elsewhere through a
naive append first), ssh-keygen's pair and the probes read back by the facts. OpenSSH's own
parser (ssh-keygen -l) reads the line we write; the sshd side (the key runs nothing, forwards
only its port) is the lab's (tests/lab/test_rootless_lab.py)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from support.nonroot import as_user, give, owned_folder
from support.require import needs
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import account, paths, probe, registry
from meshdeploy.core.context import HostContext, Step
from meshdeploy.errors import PlanError
from meshdeploy.roles.network import operations, rules, ssh_ops
from meshdeploy.roles.network import ssh as sshk
from meshdeploy.roles.network.facts import SshKey, SshLogin

ROOT = Path(__file__).resolve().parents[2]
K1 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFw8dGZklKeflHfkWWf6/UcveVRtoRiSqVJD+HFigiry"
K2 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMQdGFM6kO+DjQvwZpywNnZ1qTMpkqcEvRAZd+oial5a"
# The lab's shape: a root orchestrator, a Termux-like worker (sshd on 8022) and a root worker.
CLUSTER = """\
cluster: lab
llama_cpp:
  ref: b11312
network:
  rpc_bind: address
  transport: ssh
hosts:
  node1:
    address: 10.200.0.11
  node2:
    address: 10.200.0.12
    rootless: true
    ssh: {port: 8022}
    rpc_servers:
      - port: 50052
  node3:
    address: 10.200.0.13
    backend: cuda
    devices: [CUDA0, CUDA1]
    rpc_servers:
      - {port: 50052, device: CUDA0}
      - {port: 50053, device: CUDA1}
models:
  m: {path: /m.gguf}
servers:
  main: {host: node1, model: m, rpc: ["node2:50052", "node3:50052", "node3:50053"]}
"""
LINE1 = ('command="false",restrict,port-forwarding,permitopen="127.0.0.1:50052",'
         f'permitlisten="127.0.0.1:1",from="10.200.0.11" {K1} meshdeploy-rpc:lab:node1')
TERMUX = ["home=/data/data/com.termux/files/home", "user=u0_a123", "uid=10123", "sv=yes",
          "runsvdir=runsvdir -P /data/data/com.termux/files/usr/var/service",
          "termux_prefix=/data/data/com.termux/files/usr"]
needs_keygen = needs("ssh-keygen")


@pytest.fixture
def cluster(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return load_cluster(path)


def key_fact(key=K1, known=None):
    return {"tools": ["ssh", "ssh-keygen"], "private": key is not None, "public_key": key,
            "known_hosts": known}


def login_fact(authorized=(), host_keys=(K2,)):
    return {"user": "md", "host_keys": list(host_keys), "authorized": list(authorized),
            "unparsed": [], "authorized_link": False}


def ctx_for(cluster, name, facts):
    return HostContext(cluster, cluster.host(name), facts.get(name, {}), run_values(),
                       cluster_facts=facts)


# -- the lines -------------------------------------------------------------------------------------

def test_the_lab_line_is_the_spec_shape_and_openssh_reads_it(cluster, tmp_path):
    """node3 serves two rpc-servers to node1: one line, a permitopen per port."""
    facts = {"node1": {"network.SshKey": key_fact()}, "node3": {"network.SshLogin": login_fact()}}
    step = ssh_ops.ssh_authorize(ctx_for(cluster, "node3", facts))
    line = ('command="false",restrict,port-forwarding,permitopen="127.0.0.1:50052",'
            'permitopen="127.0.0.1:50053",permitlisten="127.0.0.1:1",from="10.200.0.11" ' + K1 +
            " meshdeploy-rpc:lab:node1")
    assert line in step.commands[0]
    node2 = ssh_ops.ssh_authorize(ctx_for(cluster, "node2", {
        **facts, "node2": {"network.SshLogin": login_fact()}}))
    assert LINE1 in node2.commands[0]
    if shutil.which("ssh-keygen"):
        # OpenSSH's own authorized_keys parser (options included) reads it as node1's key.
        (tmp_path / "ak").write_text(line + "\n")
        out = subprocess.run(["ssh-keygen", "-l", "-f", str(tmp_path / "ak")],
                             capture_output=True, text=True, check=True).stdout
        assert sshk.fingerprint(K1) in out and "meshdeploy-rpc:lab:node1" in out


def test_a_dns_name_cannot_be_a_from_source(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER.replace("address: 10.200.0.11", "address: orch.example"))
    cluster = load_cluster(path)
    facts = {"node1": {"network.SshKey": key_fact()}, "node2": {"network.SshLogin": login_fact()}}
    with pytest.raises(PlanError, match="a DNS name"):
        ssh_ops.ssh_authorize(ctx_for(cluster, "node2", facts))


def test_public_key_refuses_a_blob_of_another_type():
    assert sshk.public_key(K1 + " comment") == K1
    assert sshk.public_key("ecdsa-sha2-nistp256 " + K1.split()[1]) is None
    assert sshk.public_key("ssh-ed25519 " + K1.split()[1][:-4]) is None  # 29 of 32 bytes
    assert sshk.public_key("ssh-ed25519 AAAA$(id)") is None


# -- the authorized_keys write, for real as a user without root -----------------------------------

def run_authorize(cluster, home: Path, lines: list[str]) -> subprocess.CompletedProcess:
    script = ssh_ops.authorize_script(cluster, lines)
    return subprocess.run(as_user(["sh", "-c", script]), capture_output=True, text=True,
                          env={"HOME": str(home), "PATH": os.environ["PATH"]})


@pytest.fixture
def home():
    folder = owned_folder()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


OTHERS = (b"# my keys\r\n"
          b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGJ1 me@laptop\n"
          b'from="10.0.0.0/8,192.168.1.1",command="echo hi there" ssh-rsa AAAAB3Nza me\n'
          b"\n"
          b"   \t\n"
          b"restrict " + K2.encode() + b" meshdeploy-rpc:other:gpu1\n"
          b"ssh-ed25519 AAAA note mentions meshdeploy-rpc:lab:node1 in the middle\n")


def test_write_keeps_every_other_line_byte_for_byte_and_replaces_ours(cluster, home):
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700)
    old = LINE1.replace("50052", "50099").encode()
    (ssh / "authorized_keys").write_bytes(OTHERS + old + b"\n" + b"ssh-rsa AAAAB3 last-no-newline")
    give(home)
    proc = run_authorize(cluster, home, [LINE1])
    assert proc.returncode == 0, proc.stderr
    data = (ssh / "authorized_keys").read_bytes()
    assert data == OTHERS + b"ssh-rsa AAAAB3 last-no-newline\n" + LINE1.encode() + b"\n"
    assert stat.S_IMODE((ssh / "authorized_keys").stat().st_mode) == 0o600
    assert sorted(p.name for p in ssh.iterdir()) == ["authorized_keys"]  # no temporary left
    # Again: the same bytes (the plan would say no-op; the write itself is idempotent too).
    assert run_authorize(cluster, home, [LINE1]).returncode == 0
    assert (ssh / "authorized_keys").read_bytes() == data
    # destroy: only this cluster's line goes.
    assert run_authorize(cluster, home, []).returncode == 0
    assert (ssh / "authorized_keys").read_bytes() == OTHERS + b"ssh-rsa AAAAB3 last-no-newline\n"


def test_write_makes_the_folder_0700_and_the_file_0600(cluster, home):
    proc = run_authorize(cluster, home, [LINE1])
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE((home / ".ssh").stat().st_mode) == 0o700
    assert stat.S_IMODE((home / ".ssh" / "authorized_keys").stat().st_mode) == 0o600
    assert (home / ".ssh" / "authorized_keys").read_text() == LINE1 + "\n"
    if os.geteuid() == 0:  # written by the user, not root
        assert (home / ".ssh" / "authorized_keys").stat().st_uid != 0
    # Removing from a user with no file makes none.
    other = owned_folder()
    try:
        assert run_authorize(cluster, other, []).returncode == 0
        assert not (other / ".ssh").exists()
    finally:
        shutil.rmtree(other)


def test_a_link_at_authorized_keys_is_not_written_through(cluster, home):
    """A link planted at ~/.ssh/authorized_keys: a naive append writes where it points (shown
    first); the write refuses, and the file it points at stays as it was."""
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700)
    victim = home / "victim"
    victim.write_text("precious\n")
    (ssh / "authorized_keys").symlink_to(victim)
    give(home)
    naive = subprocess.run(as_user(["sh", "-c", 'printf "%s\\n" "$L" >> "$HOME/.ssh/authorized_keys"']),
                           env={"HOME": str(home), "L": LINE1, "PATH": os.environ["PATH"]})
    assert naive.returncode == 0 and victim.read_text() == "precious\n" + LINE1 + "\n"
    victim.write_text("precious\n")
    proc = run_authorize(cluster, home, [LINE1])
    assert proc.returncode == 1 and "symbolic link" in proc.stderr
    assert victim.read_text() == "precious\n"
    assert (ssh / "authorized_keys").is_symlink()
    assert sorted(p.name for p in ssh.iterdir()) == ["authorized_keys"]
    # The plan refuses first, from the fact.
    facts = {"node1": {"network.SshKey": key_fact()},
             "node2": {"network.SshLogin": {**login_fact(), "authorized_link": True}}}
    with pytest.raises(PlanError, match="symbolic link"):
        ssh_ops.ssh_authorize(ctx_for(cluster, "node2", facts))


def test_login_probe_reads_the_users_files(cluster, home):
    """SshLogin as the user: host keys under $PREFIX/etc/ssh (Termux), our marked lines only."""
    prefix = home / "data/data/com.termux/files/usr"
    (prefix / "etc" / "ssh").mkdir(parents=True)
    (prefix / "etc" / "ssh" / "ssh_host_ed25519_key.pub").write_text(K2 + " root@phone\n")
    (prefix / "etc" / "ssh" / "ssh_host_ed25519_key").write_text("PRIVATE\n")
    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh" / "authorized_keys").write_bytes(OTHERS + LINE1.encode() + b"\n")
    give(home)
    out = subprocess.run(as_user(["sh", "-c", SshLogin().command()]), capture_output=True,
                         text=True, env={"HOME": str(home), "PREFIX": str(prefix),
                                         "PATH": os.environ["PATH"]}).stdout.splitlines()
    fact = SshLogin().process(out)
    assert K2 in fact["host_keys"] and "PRIVATE" not in "\n".join(out)
    assert fact["authorized"] == [f"restrict {K2} meshdeploy-rpc:other:gpu1", LINE1]
    assert fact["user"] and not fact["authorized_link"]


@needs_keygen
def test_keygen_script_and_key_probe_as_the_user(home):
    """network.ssh_key's script on a rootless host's layout, then the SshKey probe: the public
    key is derived on the host; the private key is 0600 in a 0700 folder and never printed."""
    layout = account.layout(account.parse("phone", [*TERMUX[:1], "user=md", *TERMUX[2:]]))
    layout = dataclasses.replace(layout, config=str(home / ".config" / "meshdeploy"))
    key = paths.ssh_key(layout)
    path = ROOT / "meshdeploy/roles/network/templates/ssh-keygen.sh"
    from meshdeploy.core import shell

    script = shell.template(path, DIR=str(Path(key).parent), KEY=key,
                            COMMENT="meshdeploy-rpc@phone")
    proc = subprocess.run(as_user(["sh", "-c", script]), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert stat.S_IMODE(Path(key).parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(Path(key).stat().st_mode) == 0o600
    assert Path(key + ".pub").read_text().endswith(" meshdeploy-rpc@phone\n")
    command = SshKey().command(key=key, known=paths.ssh_known_hosts(layout))
    out = subprocess.run(as_user(["sh", "-c", command]), capture_output=True, text=True).stdout
    assert "PRIVATE KEY" not in out
    fact = SshKey().process(out.splitlines())
    assert fact["private"] and fact["public_key"] == sshk.public_key(Path(key + ".pub").read_text())
    assert fact["known_hosts"] is None


# -- plans ---------------------------------------------------------------------------------------

def test_a_rootless_orchestrator_keeps_its_key_in_the_users_config(cluster):
    layout = account.layout(account.parse("node1", TERMUX))
    hosts = tuple(dataclasses.replace(h, rootless=True, layout=layout) if h.name == "node1"
                  else h for h in cluster.hosts)
    cluster = dataclasses.replace(cluster, hosts=hosts)
    node1 = cluster.host("node1")
    [key, login] = ssh_ops.sections(cluster, node1)
    assert key.kwargs["key"] == "/data/data/com.termux/files/home/.config/meshdeploy/ssh/rpc_ed25519"
    assert login.key == "network.SshLogin" and not login.privileged
    # On a rootless host the privileged section runs as the user (no sudo at all).
    assert "sudo" not in probe.compose([key], "n", sudo=node1.sudo)
    step = ssh_ops.ssh_key(HostContext(cluster, node1, {"network.SshKey": key_fact(None)},
                                       run_values()))
    assert "DIR=/data/data/com.termux/files/home/.config/meshdeploy/ssh" in step.commands[0]
    assert not node1.sudo


def test_sections_by_role_of_the_host(cluster):
    node1, node2, node3 = (cluster.host(n) for n in ("node1", "node2", "node3"))
    keys = [s.key for s in operations.sections(cluster, node1)]
    assert "network.SshKey" in keys and "network.SshLogin" in keys
    [key] = [s for s in operations.sections(cluster, node1) if s.key == "network.SshKey"]
    assert key.privileged and key.kwargs["key"] == "/etc/meshdeploy/ssh/rpc_ed25519"
    # A worker too, and a plain cluster's hosts: what an earlier ssh apply (or an earlier role
    # of the host) left is found and removed.
    assert [s.key for s in operations.sections(cluster, node3)][-2:] == ["network.SshKey",
                                                                         "network.SshLogin"]
    # A rootless worker whose layout is not read yet still has its login read.
    assert [s.key for s in operations.sections(cluster, node2)] == ["network.SshLogin"]
    plain = load_cluster(ROOT / "inventories" / "lab.yaml")
    assert [s.key for s in operations.sections(plain, plain.host("node1"))
            if s.key.startswith("network.Ssh")] == ["network.SshdStreamLocal", "network.SshKey",
                                                    "network.SshLogin"]


def test_order_after_toolchain_before_services(cluster):
    names = [s.name for s in registry.slots(cluster)]
    at = names.index
    assert at("network.ssh_key") < at("network.ssh_authorize") < at("network.ssh_known_hosts")
    assert at("toolchain.packages") < at("network.ssh_key")
    assert at("network.ssh_known_hosts") < min(i for i, n in enumerate(names)
                                               if n.startswith("services."))


def test_apply_rereads_the_new_key_before_authorizing(cluster):
    """Planned with no key on node1: known after apply; at apply, node1's ssh_key ran and its
    fact was re-read (Resource.rereads), so the worker's line carries the new key."""
    resource = registry.role("network").resource("ssh_authorize") if hasattr(
        registry, "role") else next(r for r in registry.resources()
                                    if r.qualified == "network.ssh_authorize")
    assert ("network.ssh_key", "network.SshKey") in resource.rereads and resource.cluster_wide
    facts = {"node1": {"network.SshKey": key_fact(None)},
             "node2": {"network.SshLogin": login_fact()}}
    ctx = ctx_for(cluster, "node1", facts)
    keygen = ssh_ops.ssh_key(ctx)
    ctx.steps.add("node1", "network.ssh_key", keygen)
    worker = ctx_for(cluster, "node2", facts)
    worker.steps = ctx.steps
    assert ssh_ops.ssh_authorize(worker).commands == []
    facts["node1"]["network.SshKey"] = key_fact(K1)  # the re-read
    assert LINE1 in ssh_ops.ssh_authorize(worker).commands[0]


def test_rotation_on_a_worker_planned_alone_is_known_after_apply(cluster):
    facts = {"node1": {"network.SshKey": key_fact()},
             "node2": {"network.SshLogin": login_fact([LINE1])}}
    ctx = HostContext(cluster, cluster.host("node2"), facts["node2"],
                      run_values(replace=("node1/network.ssh_key",)), cluster_facts=facts)
    step = ssh_ops.ssh_authorize(ctx)
    assert step.change.action == "update" and not step.commands
    assert step.change.diffs[0].known_after_apply


def test_destroy_removes_our_lines_and_the_key_folder(cluster):
    facts = {"network.SshLogin": login_fact([LINE1, f"restrict {K2} meshdeploy-rpc:other:x"]),
             "network.SshKey": key_fact(known=["10.200.0.12 " + K2])}
    ctx = HostContext(cluster, cluster.host("node1"), facts, run_values())
    steps = ssh_ops.destroy(ctx)
    authorize, key = steps
    assert authorize.change.action == "delete" and authorize.sudo is False
    assert "LINES=''" in authorize.commands[0] and "other:x" not in authorize.commands[0]
    assert key.sudo is True and key.commands == [
        "rm -f /etc/meshdeploy/ssh/rpc_ed25519 /etc/meshdeploy/ssh/rpc_ed25519.pub "
        "/etc/meshdeploy/ssh/known_hosts; rmdir /etc/meshdeploy/ssh /etc/meshdeploy "
        "2>/dev/null || true"]
    assert ssh_ops.destroy(HostContext(cluster, cluster.host("node3"), {}, run_values())) == []
    teardown = operations.destroy(ctx, purge=False)
    assert [s.change.resource for s in teardown.steps][-2:] == ["ssh_authorize", "ssh_key"]


def test_preflight_needs_ssh_on_an_orchestrator(cluster):
    facts = {"network.SshKey": {**key_fact(), "tools": ["ssh-keygen"]},
             "toolchain.Platform": {"termux": True}}
    with pytest.raises(PlanError, match="no ssh on PATH") as info:
        ssh_ops.preflight(HostContext(cluster, cluster.host("node1"), facts, run_values()))
    assert info.value.hint == "pkg install openssh"
    assert ssh_ops.preflight(HostContext(cluster, cluster.host("node3"), {}, run_values())) is None


# -- the allow-list and the Hosts table ------------------------------------------------------------

def test_no_allowlist_rule_for_loopback_rpc_ports_under_ssh(cluster):
    # No input rule: loopback only. The output chain keeps other local users out (root and the
    # login user, rules.local_ports; tests/unit/test_loopback_rpc_private.py).
    assert rules.allowlist(cluster, cluster.host("node3"), login_uid=1000) == {
        "loopback/50052": ["uid 0", "uid 1000"], "loopback/50053": ["uid 0", "uid 1000"]}
    assert rules.ports(cluster, cluster.host("node3")) == []
    plain = load_cluster(ROOT / "inventories" / "lab.yaml")
    assert rules.allowlist(plain, plain.host("node2")) == {"50052": ["lo", "10.200.0.11"]}
    wg = load_cluster(ROOT / "inventories" / "lab-wireguard.yaml")
    assert "10.99.149.186 via mdwg0" in rules.allowlist(wg, wg.host("node2"))["50052"]


def test_hosts_table_says_workers_are_reached_through_forwards(cluster, tmp_path):
    rows = dict((h, text) for h, _, text in operations.access(cluster, cluster.hosts, {}))
    assert rows == {"node1": "allow-list (nftables)",
                    "node2": "loopback only; reached through ssh forwards",
                    "node3": "loopback only, for root and the login user (nftables); reached "
                             "through ssh forwards"}
    # A worker that also serves a llama-server keeps the allow-list for its port.
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER.replace(', "node3:50053"]', "]").replace(
        "models:\n", "models:\n  m2: {path: /m2.gguf}\n") + "  side: {host: node3, model: m2, "
        "port: 8081, rpc: ['node3:50053']}\n")
    both = load_cluster(path)
    rows = dict((h, text) for h, _, text in operations.access(both, both.hosts, {}))
    assert rows["node3"] == ("loopback only, for root and the login user (nftables); reached "
                             "through ssh forwards; allow-list (nftables)")
    plain = load_cluster(ROOT / "inventories" / "lab.yaml")
    assert {t for _, _, t in operations.access(plain, plain.hosts, {})} == {
        "allow-list (nftables)"}


def test_known_hosts_plan_pins_and_no_ops(cluster):
    login = login_fact()
    facts = {"node1": {"network.SshKey": key_fact()}, "node2": {"network.SshLogin": login},
             "node3": {"network.SshLogin": login}}
    step = ssh_ops.ssh_known_hosts(ctx_for(cluster, "node1", facts))
    want = [f"[10.200.0.12]:8022 {K2}", f"10.200.0.13 {K2}"]
    assert "\n".join(want) + "\n" in step.commands[1]
    facts["node1"]["network.SshKey"] = key_fact(known=want)
    assert ssh_ops.ssh_known_hosts(ctx_for(cluster, "node1", facts)).noop
    assert isinstance(step, Step)


def port_issues(tmp_path, text: str) -> list[str]:
    from meshdeploy.errors import ConfigError

    path = tmp_path / "ports.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    return [str(i)[len(str(path)) + 1:] for i in info.value.issues]


def test_a_llama_server_on_a_forwards_port_is_told_to_move_at_its_own_port(tmp_path):
    text = CLUSTER.replace("  main: {host: node1, model: m,", "  main: {host: node1, model: m, "
                           "port: 31001,")
    (issue,) = port_issues(tmp_path, text)
    assert "servers.main.port: port 31001 on host node1 is already used by the forward to " \
           "node3" in issue, issue


def test_an_rpc_server_on_a_forwards_port_is_said_at_the_setting_the_ports_follow_from(tmp_path):
    text = CLUSTER.replace("  node1:\n    address: 10.200.0.11\n",
                           "  node1:\n    address: 10.200.0.11\n    rpc_servers:\n"
                           "      - port: 31000\n")
    text = text.replace("  transport: ssh\n", "  transport: ssh\n  ssh: {local_port_base: 31000}\n")
    (issue,) = port_issues(tmp_path, text)
    assert "network.ssh.local_port_base: port 31000 on host node1 is taken by " \
           "hosts.node1.rpc_servers[0], but the ssh forward to node2:50052 listens there" in issue, \
        issue
