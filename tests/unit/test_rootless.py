"""Hosts without root: the cluster file's rules (one error at file:line each) and what the
account probe makes of a host (core.account): its folders and its service manager, or the one
command that gives it one."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support.resolved import run_values

from meshdeploy.config.checks import warnings_for
from meshdeploy.core.loading import load_cluster
from meshdeploy.config.model import RUNIT, SYSTEMD_USER
from meshdeploy.core import account
from meshdeploy.errors import ConfigError, PlanError

HEAD = "cluster: t\nllama_cpp:\n  ref: b1\n"


def cluster_text(worker: str, network: str = "") -> str:
    return (HEAD + network + "hosts:\n  node1:\n    address: 10.0.0.1\n"
            "  phone:\n    address: 10.0.0.2\n" + worker +
            "    rpc_servers:\n      - port: 50052\n"
            "models:\n  m: {path: /m.gguf}\n"
            "servers:\n  main: {host: node1, model: m}\n")


def load(tmp_path: Path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path, load_cluster(path)


def issues(tmp_path: Path, text: str) -> list[tuple[int, str]]:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    return [(i.line, i.message) for i in info.value.issues]


def test_a_rootless_host_under_the_firewall_is_refused_at_its_line(tmp_path):
    found = issues(tmp_path, cluster_text("    rootless: true\n"))
    assert len(found) == 1
    line, message = found[0]
    assert line == 9  # "    rootless: true"
    assert "cannot hold network.firewall's allow-list" in message


def test_the_acknowledgement_is_accepted_and_warned(tmp_path):
    _, cluster = load(tmp_path, cluster_text("    rootless: true\n    unprotected: true\n"))
    phone = cluster.host("phone")
    assert phone.rootless and phone.unprotected and not phone.sudo
    assert phone.layout is None  # read from the host when a session connects
    assert cluster.host("node1").layout.prefix == "/opt/meshdeploy"
    [warning] = [w for w in warnings_for(cluster) if "phone" in w]
    assert "no allow-list guards its rpc-server port(s) 50052" in warning


def test_without_the_firewall_no_acknowledgement_is_needed(tmp_path):
    _, cluster = load(tmp_path, cluster_text("    rootless: true\n",
                                             "network:\n  firewall: false\n"))
    assert cluster.host("phone").rootless
    assert not [w for w in warnings_for(cluster) if "rootless" in w]


def test_sudo_wireguard_and_a_stray_acknowledgement_are_refused(tmp_path):
    found = issues(tmp_path, cluster_text(
        "    rootless: true\n    ssh: {sudo: true}\n",
        "network:\n  transport: wireguard\n"))
    messages = [m for _, m in found]
    assert any("nothing runs through sudo" in m for m in messages)
    assert any("network.transport: wireguard makes a network interface" in m for m in messages)
    found = issues(tmp_path, cluster_text("    unprotected: true\n"))
    assert [m for _, m in found if "is not rootless" in m]


def test_rootless_is_not_for_the_local_host(tmp_path):
    text = (HEAD + "network:\n  firewall: false\nhosts:\n  here:\n    address: 127.0.0.1\n"
            "    connection: local\n    rootless: true\nmodels: {}\n")
    assert any("connection: local" in m for _, m in issues(tmp_path, text))


# -- core.account --------------------------------------------------------------------------

TERMUX_SV = "/data/data/com.termux/files/usr/var/service"


def parsed(**values) -> account.Account:
    base = {"home": "/home/md", "user": "md", "uid": "1000"}
    base.update(values)
    return account.parse("phone", [f"{k}={v}" for k, v in base.items()])


def test_systemd_user_with_lingering_gets_xdg_folders():
    layout = account.layout(parsed(systemd_user="degraded", linger="yes",
                                   runtime="/run/user/1000"))
    assert layout.manager == SYSTEMD_USER and layout.rootless
    assert (layout.prefix, layout.cache, layout.run, layout.services) == (
        "/home/md/.local/share/meshdeploy", "/home/md/.cache/meshdeploy",
        "/run/user/1000/meshdeploy", "/home/md/.config/systemd/user")


def test_xdg_variables_are_honoured_and_checked():
    layout = account.layout(parsed(systemd_user="running", linger="yes",
                                   xdg_data="/data/md", xdg_cache="/scratch/md cache"))
    assert layout.prefix == "/data/md/meshdeploy"
    assert layout.cache == "/scratch/md cache/meshdeploy"
    assert layout.run == "/scratch/md cache/meshdeploy/run"  # no XDG_RUNTIME_DIR
    with pytest.raises(PlanError, match="not an absolute path"):
        account.layout(parsed(systemd_user="running", linger="yes", xdg_data="relative"))
    with pytest.raises(PlanError, match="not an absolute path"):
        account.layout(parsed(systemd_user="running", linger="yes", home="/home/../etc"))


def test_without_lingering_the_admin_command_is_named():
    with pytest.raises(PlanError) as info:
        account.layout(parsed(systemd_user="running", linger="no"))
    assert info.value.hint == "an administrator of the host runs, once: loginctl enable-linger md"


def test_termux_runit_uses_prefix_var_service():
    layout = account.layout(parsed(home="/data/data/com.termux/files/home", sv="yes",
                                   runsvdir=f"runsvdir -P {TERMUX_SV}",
                                   termux_prefix="/data/data/com.termux/files/usr"))
    assert layout.manager == RUNIT
    assert layout.services == "/data/data/com.termux/files/usr/var/service"
    assert layout.prefix == "/data/data/com.termux/files/home/.local/share/meshdeploy"


def test_runit_counts_only_with_a_runsvdir_over_the_service_folder():
    """A runsvdir of the user over another folder would never start what apply writes into
    SVDIR: refused before anything changes, as with none at all."""
    termux = {"home": "/data/data/com.termux/files/home", "sv": "yes",
              "termux_prefix": "/data/data/com.termux/files/usr"}
    with pytest.raises(PlanError, match=f"no runsvdir of the user runs over {TERMUX_SV}"):
        account.layout(parsed(runsvdir="runsvdir -P /home/md/other-services", **termux))
    lines = [f"{k}={v}" for k, v in {"home": "/h", "user": "md", **termux}.items()]
    two = account.parse("phone", lines + ["runsvdir=/usr/bin/runsvdir /etc/service",
                                          f"runsvdir=runsvdir -P {TERMUX_SV}/ log: ......"])
    assert account.layout(two).manager == RUNIT


def test_no_service_manager_names_both_fixes():
    with pytest.raises(PlanError) as info:
        account.layout(parsed(sv="yes"))  # runit installed, but no runsvdir of the user
    assert "no service manager for md" in info.value.message
    assert "loginctl enable-linger md" in info.value.hint
    assert "pkg install termux-services" in info.value.hint


def test_the_script_reads_this_machine(tmp_path):
    """The account script as sh runs it: values from the environment, one line each."""
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "XDG_DATA_HOME": "/x y",
           "SVDIR": str(tmp_path / "sv")}
    out = subprocess.run(["sh", "-c", account.SCRIPT], env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    read = account.parse("here", out)
    assert read.get("home") == str(tmp_path)
    assert read.get("xdg_data") == "/x y"
    assert read.get("svdir") == str(tmp_path / "sv")
    assert read.get("uid").isdigit()


# -- what the plan says per host -------------------------------------------------------------

def resolved_cluster(tmp_path: Path, worker: str = "    rootless: true\n    unprotected: true\n"):
    from meshdeploy.config.model import Layout

    _, cluster = load(tmp_path, cluster_text(worker))
    phone = Layout(prefix="/home/md/.local/share/meshdeploy", cache="/home/md/.cache/meshdeploy",
                   run="/run/user/1000/meshdeploy", services="/home/md/.config/systemd/user",
                   manager=SYSTEMD_USER, home="/home/md", user="md")
    return account.resolved(cluster, {"phone": phone})


def test_the_plan_names_access_services_and_guard_per_host(tmp_path):
    from meshdeploy.core import registry
    from meshdeploy.engine.planner import host_access, prepare
    from meshdeploy.views.plan import render_access

    cluster = resolved_cluster(tmp_path)
    facts = {"node1": {"toolchain.Platform": {"kernel": "Linux"}}, "phone": {}}
    roles = [registry.role("network"), registry.role("services")]
    said = prepare(cluster, cluster.hosts, facts, roles=roles).access
    text = render_access(host_access(cluster.hosts, said))
    title, header, _rule, node1, phone = text.splitlines()
    assert (title, header.split()[:4]) == ("Hosts:", ["host", "access", "service", "manager"])
    assert node1.split("  ")[0] == "node1" and "root (sudo)" in node1
    assert node1.split()[-3:] == ["systemd", "allow-list", "(nftables)"]
    assert "rootless (user md)" in phone and "systemd --user" in phone
    assert phone.rstrip().endswith("nothing: unprotected (no root for nftables)")
    # A cluster without a rootless host prints no table: every host is root + systemd.
    _, plain = load(tmp_path, cluster_text(""))
    assert host_access(plain.hosts, prepare(plain, plain.hosts, facts, roles=roles).access) == []


def test_the_network_role_reads_and_loads_nothing_on_a_rootless_host(tmp_path):
    from meshdeploy.core.context import HostContext
    from meshdeploy.roles.network import operations as network

    cluster = resolved_cluster(tmp_path)
    phone, node1 = cluster.host("phone"), cluster.host("node1")
    # Only what an earlier network.transport: ssh apply may have left (the forwards' key pair,
    # the login user's authorized lines): nothing of the allow-list or WireGuard.
    assert [s.key for s in network.sections(cluster, phone)] == ["network.SshKey",
                                                                 "network.SshLogin"]
    assert [s.key for s in network.sections(cluster, node1)][:2] == ["network.Tools",
                                                                     "network.Allowlist"]
    step = network.allowlist(HostContext(cluster, phone, {}, run_values()))
    assert (step.change.action, step.change.reason, step.commands) == (
        "no-op", "rootless: no allow-list without root", [])


def test_a_rootless_host_that_listens_on_nothing_needs_no_acknowledgement(tmp_path):
    """llama-server on 127.0.0.1 and no rpc-server: nothing an allow-list would guard."""
    text = (HEAD + "hosts:\n  phone:\n    address: 10.0.0.2\n    rootless: true\n"
            "models:\n  m: {path: /m.gguf}\nservers:\n  main: {host: phone, model: m}\n")
    _, cluster = load(tmp_path, text)
    assert cluster.host("phone").rootless
    text = text.replace("{host: phone, model: m}",
                        "{host: phone, model: m, bind: 10.0.0.2, allow_unauthenticated: true}")
    assert [m for _, m in issues(tmp_path, text) if "or llama-server would be open" in m]


def test_host_text_that_would_steer_a_terminal_is_refused_or_dropped():
    """HOME and the login name come from the host and are printed in plans: an escape sequence
    (C1's CSI too) is refused in a path, and a login name that is not a portable user name is
    not shown."""
    with pytest.raises(PlanError, match="not an absolute path"):
        account.layout(parsed(systemd_user="running", linger="yes", home="/h/\x9b31m"))
    layout = account.layout(parsed(systemd_user="running", linger="yes",
                                   user="md\x1b]2;owned\x07"))
    assert layout.user == ""
    with pytest.raises(PlanError) as info:
        account.layout(parsed(systemd_user="running", linger="no", user="md\x1b[31m"))
    assert "\x1b" not in info.value.message + info.value.hint
    assert "loginctl enable-linger the login user" in info.value.hint


def test_an_unprotected_llama_server_on_the_network_is_warned(tmp_path):
    text = cluster_text("    rootless: true\n    unprotected: true\n").replace(
        "  main: {host: node1, model: m}",
        "  main: {host: phone, model: m, bind: 10.0.0.2, allow_unauthenticated: true}")
    _, cluster = load(tmp_path, text)
    assert [w for w in warnings_for(cluster) if "guards llama-server main on 10.0.0.2:8080" in w]


def test_a_saved_plan_is_stale_when_a_rootless_hosts_folders_changed(tmp_path, monkeypatch):
    """The layout read at apply is part of the host's fingerprint: a plan made for other folders
    (XDG_DATA_HOME changed, runit instead of systemd --user) is refused, not applied there."""
    from dataclasses import replace
    from types import SimpleNamespace

    from meshdeploy.core import probe
    from meshdeploy.engine import planner

    cluster = resolved_cluster(tmp_path)

    def fingerprint(c):
        session = SimpleNamespace(cluster=c, hosts=lambda: list(c.hosts), run=lambda *a, **k: (
            True, SimpleNamespace(stdout_lines=[], stderr_lines=[])))
        monkeypatch.setattr(probe, "decode", lambda sections, parts: {})
        monkeypatch.setattr(probe, "split", lambda lines, sections, nonce: {})
        facts = planner.gather(session)
        return {h: probe.fingerprint(f, ()) for h, f in facts.items()}

    before = fingerprint(cluster)
    moved = replace(cluster.host("phone").layout, prefix="/data/md/meshdeploy")
    after = fingerprint(account.resolved(cluster, {"phone": moved}))
    assert before["node1"] == after["node1"]
    assert before["phone"] != after["phone"]


def test_a_host_that_changes_between_root_and_rootless_is_refused(tmp_path):
    """Set up with root, then made rootless in the file (or the reverse): its system units
    would keep running beside the user's own and hold the ports."""
    from meshdeploy.engine import state as states

    _, with_root = load(tmp_path, cluster_text("", "network:\n  firewall: false\n"))
    state = states.State(path=tmp_path / "c.state.json", cluster="t")
    for host in with_root.hosts:
        state.hosts[host.name] = states.record_for(with_root, host)
    state.same_access(with_root)  # the same file: nothing changed
    _, rootless = load(tmp_path, cluster_text("    rootless: true\n",
                                              "network:\n  firewall: false\n"))
    with pytest.raises(PlanError) as info:
        state.same_access(rootless)
    assert info.value.message.startswith("phone: the cluster file says rootless: true, but "
                                         "meshdeploy set it up with root")
    assert "destroy --limit phone" in info.value.hint
    state.same_access(rootless, limit=["node1"])  # a run that leaves the host out
    state.hosts["phone"] = states.record_for(rootless, rootless.host("phone"))
    with pytest.raises(PlanError, match="set it up rootless"):
        state.same_access(with_root)


def test_a_rootless_host_never_resolves_the_ref_for_root_hosts(tmp_path, monkeypatch):
    """The first host in file order resolves llama_cpp.ref by ls-remote when nothing pins it,
    and every host then compiles and runs that commit: a rootless host's login user (its
    ~/.gitconfig, a `git` earlier on its PATH) must not choose it for hosts with root. The
    first host with root does; the first host only when every host is rootless."""
    from types import SimpleNamespace

    from meshdeploy.core import probe, registry
    from meshdeploy.engine import planner

    phone_first = (HEAD + "hosts:\n  phone:\n    address: 10.0.0.2\n    rootless: true\n"
                   "    unprotected: true\n    rpc_servers:\n      - port: 50052\n"
                   "  node1:\n    address: 10.0.0.1\n"
                   "models:\n  m: {path: /m.gguf}\nservers:\n  main: {host: node1, model: m}\n")
    _, cluster = load(tmp_path, phone_first)
    assert [h.name for h in cluster.hosts] == ["phone", "node1"]
    assert registry.resolver(cluster.hosts) == "node1"
    assert registry.resolver([cluster.host("phone")]) == "phone"  # all rootless: the first
    assert registry.resolver([]) is None

    asked = {}
    real = planner.probe_command

    def probe_command(cluster_, host, first, *rest):
        asked[host.name] = first
        return real(cluster_, host, first, *rest)

    monkeypatch.setattr(planner, "probe_command", probe_command)
    monkeypatch.setattr(probe, "decode", lambda sections, parts: {})
    monkeypatch.setattr(probe, "split", lambda lines, sections, nonce: {})
    session = SimpleNamespace(cluster=cluster, hosts=lambda: list(cluster.hosts),
                              run=lambda *a, **k: (True, SimpleNamespace(stdout_lines=[],
                                                                         stderr_lines=[])))
    planner.gather(session)
    assert asked == {"phone": False, "node1": True}  # only node1 runs ls-remote
