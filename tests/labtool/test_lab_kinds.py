"""Lab hosts whose login user has no root: `rootless-systemd` and `termux` (lab/kinds.py).

The unit tests check the --kind option, the recipe, the refusals and the ssh_config. The lab
tests bring up one lab of their own, `mdkinds` (no mirrors): node1 a root host, node2 termux,
node3 rootless-systemd, and check over real SSH, through the lab's ssh_config, what each kind
promises; most checks run on a host of another kind too, where the answer differs.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from support.require import require
from conftest import own_lab

from meshdeploy.lab import Lab, LabError, LabInfo, base, kinds
from meshdeploy.lab.cli import build_parser, main
from meshdeploy.lab.labinfo import render_ssh_config

KINDS_LAB = "mdkinds"
ROOT_HOST, TERMUX_HOST, SYSTEMD_HOST = "node1", "node2", "node3"
MD_HOSTS = (TERMUX_HOST, SYSTEMD_HOST)
LAYOUT = {TERMUX_HOST: kinds.TERMUX, SYSTEMD_HOST: kinds.ROOTLESS_SYSTEMD}
PREFIX = kinds.TERMUX_PREFIX
SVDIR = f"{PREFIX}/var/service"


# -- without a lab ----------------------------------------------------------------------------


def test_kind_options_parse_into_a_host_map():
    args = build_parser().parse_args(["up", "--toolchain", "--kind", "node2=termux",
                                      "--kind", "node3=rootless-systemd"])
    assert kinds.parse(args.kind) == LAYOUT
    assert build_parser().parse_args(["up"]).kind == []
    assert kinds.parse([]) == {}


@pytest.mark.parametrize("value", ["node2", "node2=", "=termux", "node2:termux"])
def test_a_malformed_kind_option_is_refused(value):
    with pytest.raises(LabError, match="HOST=KIND"):
        kinds.parse([value])


def test_a_host_named_twice_is_refused():
    with pytest.raises(LabError, match="node2 twice"):
        kinds.parse(["node2=termux", "node2=rootless-systemd"])


def test_hosts_are_root_hosts_unless_named():
    every = kinds.resolve(LAYOUT, ["node1", "node2", "node3", "node4"], toolchain=True)
    assert every == {"node1": "root", "node2": "termux", "node3": "rootless-systemd",
                     "node4": "root"}
    assert kinds.resolve(None, ["node1"], toolchain=False) == {"node1": "root"}
    assert kinds.resolve({"node1": "root"}, ["node1"], toolchain=False) == {"node1": "root"}


def test_unknown_kinds_hosts_and_kinds_without_the_toolchain_are_refused():
    with pytest.raises(LabError, match="unknown host kind 'android'.*root, rootless-systemd"):
        Lab(name="mdkx", hosts=2, toolchain=True, kinds={"node2": "android"})
    with pytest.raises(LabError, match="node5, not a host of this lab"):
        Lab(name="mdkx", hosts=2, toolchain=True, kinds={"node5": "termux"})
    with pytest.raises(LabError, match="toolchain=True"):
        Lab(name="mdkx", hosts=2, kinds={"node2": "termux"})
    # A rogue host is a host of the lab like any other.
    lab = Lab(name="mdkx", hosts=2, rogue=1, toolchain=True, kinds={"node3": "termux"})
    assert lab.kinds == {"node1": "root", "node2": "root", "node3": "termux"}


def test_the_command_line_refuses_an_unknown_kind_before_starting_anything(capsys):
    assert main(["up", "--name", "mdkx", "--toolchain", "--kind", "node2=phone"]) == 1
    err = capsys.readouterr().err
    assert "unknown host kind 'phone'" in err and "lab down" not in err


def test_kinds_get_a_base_of_their_own_and_leave_the_others_alone():
    plain, tools = base.recipe(), base.recipe(toolchain=True)
    users = base.recipe(toolchain=True, user_services=True)
    assert users["packages"] == tools["packages"] + list(base.USER_SERVICES)
    assert {"runit", "libpam-systemd"} <= set(users["packages"])
    assert len({base.recipe_hash(r) for r in (plain, tools, users)}) == 3
    # The two older bases keep their recipe (and their caches): kinds change neither.
    assert plain["setup"] == tools["setup"] == base.setup_script()
    assert users["setup"] == base.setup_script() + base.USER_SERVICES_SETUP
    assert "runit.service" in base.USER_SERVICES_SETUP
    assert not kinds.user_services({"node1": "root"})
    assert kinds.user_services({"node1": "root", "node2": "termux"})


def test_ssh_config_logs_in_as_each_kinds_user_on_its_port(tmp_path):
    every = kinds.resolve(LAYOUT, ["node1", "node2", "node3"], toolchain=True)
    text = render_ssh_config("mdkx", ["node1", "node2", "node3"], Path("/k"), every)
    # A root host's entry is what it was before kinds existed.
    assert text.split("\n\n")[0] == render_ssh_config("mdkx", ["node1"], Path("/k")).strip()
    blocks = {b.split()[1]: b for b in text.strip().split("\n\n")}
    assert "User deploy" in blocks["node1"] and "Port" not in blocks["node1"]
    assert "User md" in blocks["node3"] and "Port" not in blocks["node3"]
    assert "User md" in blocks["node2"] and "    Port 8022\n" in blocks["node2"]
    assert blocks["node2"].endswith("nc 127.0.0.1 %p")
    assert blocks["node3"].endswith("nc 127.0.0.1 22")
    # paramiko (pyinfra, fabric) reads it the way OpenSSH does: port 8022, %p expanded to it.
    from paramiko import SSHConfig

    config = SSHConfig.from_text(text)
    node2 = config.lookup("node2")
    assert (node2["user"], node2["port"]) == ("md", "8022")
    assert node2["proxycommand"] == "ip netns exec mdkx-node2 nc 127.0.0.1 8022"
    assert config.lookup("node3")["proxycommand"].endswith("nc 127.0.0.1 22")


def test_a_lab_json_from_before_kinds_reads_as_root_hosts():
    old = {"name": "mdlab", "state_dir": "/s", "bridge_address": "10.200.0.1",
           "hosts": [{"name": "node1", "address": "10.200.0.11", "netns": "mdlab-node1"}],
           "ssh": {"user": "deploy", "key": "/k", "config": "/c"}, "mirrors": {}}
    host = LabInfo.from_dict(old).hosts[0]
    assert (host.kind, host.user, host.port) == ("root", "deploy", 22)
    again = LabInfo.from_dict(json.loads(json.dumps(LabInfo.from_dict(old).to_dict())))
    assert again.hosts[0].kind == "root"


@pytest.mark.parametrize("kind", [k for k in kinds.KINDS.values() if k.script],
                         ids=lambda k: k.name)
def test_kind_scripts_pass_shellcheck(kind, tmp_path):
    require("shellcheck")
    script = tmp_path / f"{kind.name}.sh"
    script.write_text("#!/bin/sh\n" + kind.script)
    out = subprocess.run(["shellcheck", "--shell=sh", "--format=gcc", str(script)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # Every input the script reads is one apply() passes.
    names = {name for name, _ in kind.env}
    for word in ("PREFIX", "SVDIR", "LOGDIR", "TERMUX_HOME", "SESSION_ENV"):
        assert (f"${word}" in kind.script) <= (word in names), word


# -- on a lab of its own ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def kinds_lab(lab_available, request):
    """LabInfo of lab mdkinds: node1 root, node2 termux, node3 rootless-systemd."""
    started = time.monotonic()
    with own_lab(request, KINDS_LAB, hosts=3, toolchain=True, mirrors=False,
                 kinds=LAYOUT) as (info, _):
        print(f"lab {KINDS_LAB} up in {time.monotonic() - started:.1f} s")
        yield info


def ssh(info, host: str, command: str, *options: str,
        timeout: float = 60) -> subprocess.CompletedProcess:
    """`ssh -F <the lab's ssh_config> [options] host command`, nothing else."""
    return subprocess.run(["ssh", "-F", info.ssh["config"], *options, host, command],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def until(probe, what: str, seconds: float = 30.0):
    """probe()'s first truthy answer within `seconds`, else fail naming `what`."""
    deadline = time.monotonic() + seconds
    while True:
        answer = probe()
        if answer or time.monotonic() > deadline:
            assert answer, f"{what}: not within {seconds:.0f} s"
            return answer
        time.sleep(0.5)


@pytest.mark.lab
def test_lab_json_records_each_hosts_kind(kinds_lab):
    described = LabInfo.load(Path(kinds_lab.state_dir))
    assert [(h.name, h.kind, h.user, h.port) for h in described.hosts] == [
        ("node1", "root", "deploy", 22), ("node2", "termux", "md", 8022),
        ("node3", "rootless-systemd", "md", 22)]
    assert described.base == base.recipe_hash(base.recipe(toolchain=True, user_services=True))


@pytest.mark.lab
def test_a_running_lab_refuses_other_kinds_or_another_base(kinds_lab):
    swapped = {TERMUX_HOST: kinds.ROOTLESS_SYSTEMD, SYSTEMD_HOST: kinds.TERMUX}
    with pytest.raises(LabError, match="node2 is termux, not rootless-systemd"):
        Lab(name=KINDS_LAB, hosts=3, toolchain=True, mirrors=False, kinds=swapped).up()
    with pytest.raises(LabError, match="runs on base"):
        Lab(name=KINDS_LAB, hosts=3, toolchain=True, mirrors=False).up()


@pytest.mark.lab
def test_the_lab_key_logs_in_as_md_with_no_root(kinds_lab):
    for host in MD_HOSTS:
        # The ssh_config alone: no user, port or key on the command line.
        who = ssh(kinds_lab, host, "id")
        assert who.returncode == 0, who.stderr
        assert "(md)" in who.stdout
        assert ssh(kinds_lab, host, "id -u").stdout.strip() != "0"
        sudo = ssh(kinds_lab, host, "sudo -n true")
        assert sudo.returncode != 0 and "password is required" in sudo.stderr
        # The lab key does not open root either; root's password is locked (`su` is no way).
        assert ssh(kinds_lab, f"root@{host}", "true", "-o", "BatchMode=yes").returncode != 0
        shadow = kinds_lab.run(host, "getent shadow root md | cut -d: -f1,2", root=True)
        assert shadow.returncode == 0, shadow.stderr
        for line in shadow.stdout.split():
            assert line.split(":")[1][:1] in ("*", "!"), line
        assert kinds_lab.run(host, "getent passwd deploy", root=True).stdout == ""
        rules = kinds_lab.run(host, "sudo -l -U md", root=True)
        assert "md is not allowed to run sudo" in rules.stdout, rules.stdout + rules.stderr
    # On the root host the same checks answer the other way.
    assert ssh(kinds_lab, ROOT_HOST, "sudo -n id -u").stdout.strip() == "0"
    assert "may run" in kinds_lab.run(ROOT_HOST, "sudo -l -U deploy", root=True).stdout
    assert ssh(kinds_lab, f"root@{ROOT_HOST}", "true", "-o", "BatchMode=yes").returncode == 0


@pytest.mark.lab
def test_rootless_systemd_runs_md_s_user_manager_from_boot(kinds_lab):
    linger = ssh(kinds_lab, SYSTEMD_HOST, "loginctl show-user md -p Linger")
    assert linger.stdout.strip() == "Linger=yes", linger.stdout + linger.stderr
    state = ssh(kinds_lab, SYSTEMD_HOST, "systemctl --user is-system-running --wait")
    assert state.stdout.strip() in ("running", "degraded"), state.stdout + state.stderr
    env = ssh(kinds_lab, SYSTEMD_HOST, 'echo "$XDG_RUNTIME_DIR"; id -u')
    runtime, uid = env.stdout.split()
    assert runtime == f"/run/user/{uid}"
    # The root host's deploy gets a user manager only while logged in: no lingering.
    root_linger = ssh(kinds_lab, ROOT_HOST, "loginctl show-user deploy -p Linger")
    assert root_linger.stdout.strip() == "Linger=no"


@pytest.mark.lab
def test_rootless_systemd_user_units_log_to_md_s_own_journal(kinds_lab):
    nonce = uuid.uuid4().hex
    unit = f"md-kinds-{nonce[:8]}"
    ran = ssh(kinds_lab, SYSTEMD_HOST,
              f"systemd-run --user --unit {unit} --wait sh -c 'echo said-{nonce}'")
    assert ran.returncode == 0, ran.stderr
    until(lambda: f"said-{nonce}" in ssh(kinds_lab, SYSTEMD_HOST,
                                          f"journalctl --user -u {unit} -o cat").stdout,
          "the unit's line in journalctl --user")
    # Another unit's name finds nothing: the check reads that unit's own output.
    other = ssh(kinds_lab, SYSTEMD_HOST, f"journalctl --user -u {unit}-none -o cat")
    assert f"said-{nonce}" not in other.stdout


@pytest.mark.lab
def test_termux_has_no_systemd_for_md(kinds_lab):
    user = ssh(kinds_lab, TERMUX_HOST, "systemctl --user is-system-running")
    assert user.returncode != 0, user.stdout
    assert ssh(kinds_lab, SYSTEMD_HOST, "systemctl --user is-system-running").returncode == 0
    masked = kinds_lab.run(TERMUX_HOST, "systemctl is-enabled user@.service", root=True)
    assert masked.stdout.strip() == "masked"


@pytest.mark.lab
def test_termux_sshd_listens_on_8022_only(kinds_lab):
    def listening(host: str, port: int) -> bool:
        netns = kinds_lab.host(host).netns
        return subprocess.run(["ip", "netns", "exec", netns, "nc", "-z", "-w", "2",
                               "127.0.0.1", str(port)], capture_output=True).returncode == 0

    assert (listening(TERMUX_HOST, 22), listening(TERMUX_HOST, 8022)) == (False, True)
    assert (listening(SYSTEMD_HOST, 22), listening(SYSTEMD_HOST, 8022)) == (True, False)
    # OpenSSH asked for port 22 goes there (%p), and is refused, as by a phone.
    assert ssh(kinds_lab, TERMUX_HOST, "true", "-p", "22", "-o", "BatchMode=yes",
               timeout=30).returncode == 255


@pytest.mark.lab
def test_termux_session_has_termux_s_environment(kinds_lab):
    env = dict(line.split("=", 1) for line in
               ssh(kinds_lab, TERMUX_HOST, "env").stdout.splitlines() if "=" in line)
    for name, value in kinds.TERMUX_ENV:
        assert env.get(name) == value, name
    assert env["HOME"] == kinds.TERMUX_HOME
    assert "XDG_RUNTIME_DIR" not in env
    owners = ssh(kinds_lab, TERMUX_HOST, 'cd && pwd && stat -c %U "$HOME" "$PREFIX" "$SVDIR"')
    assert owners.stdout.split() == [kinds.TERMUX_HOME, "md", "md", "md"]
    # A host of another kind has none of it.
    assert "PREFIX=" not in ssh(kinds_lab, SYSTEMD_HOST, "env").stdout


RUNSVDIRS = "ps -eo user=,args= | grep '[r]unsvdir' || true"


@pytest.mark.lab
def test_termux_runs_md_s_runsvdir_and_no_other(kinds_lab):
    found = kinds_lab.run(TERMUX_HOST, RUNSVDIRS, root=True).stdout.split("\n")
    assert [line.split() for line in found if line] == [["md", "/usr/bin/runsvdir", "-P",
                                                         SVDIR]]
    for host in (ROOT_HOST, SYSTEMD_HOST):
        assert kinds_lab.run(host, RUNSVDIRS, root=True).stdout.strip() == ""


RUN = """#!/bin/sh
exec 2>&1
echo "{name} up as $(id -un) {nonce}"
exec sleep 600
"""
LOG_RUN = """#!/bin/sh
exec "$PREFIX/share/termux-services/svlogger"
"""


@pytest.mark.lab
def test_termux_service_runs_as_md_under_sv_with_its_log(kinds_lab):
    nonce = uuid.uuid4().hex
    name = f"probe{nonce[:6]}"
    service = f"{SVDIR}/{name}"
    # Made down first, then started with sv: it must be runsvdir that picked it up.
    made = ssh(kinds_lab, TERMUX_HOST, f"""set -e
        mkdir -p {service}/log && touch {service}/down
        cat > {service}/run <<'EOF'
{RUN.format(name=name, nonce=nonce)}EOF
        cat > {service}/log/run <<'EOF'
{LOG_RUN}EOF
        chmod +x {service}/run {service}/log/run""")
    assert made.returncode == 0, made.stderr
    until(lambda: ssh(kinds_lab, TERMUX_HOST, f"sv status {name}").stdout.startswith("down:"),
          "runsvdir picking the service up")
    up = ssh(kinds_lab, TERMUX_HOST, f"sv up {name}")
    assert up.returncode == 0, up.stdout + up.stderr
    until(lambda: ssh(kinds_lab, TERMUX_HOST, f"sv status {name}").stdout.startswith("run:"),
          f"{name} running")
    log = until(lambda: ssh(kinds_lab, TERMUX_HOST,
                            f'cat "$LOGDIR/sv/{name}/current" 2>/dev/null').stdout,
                "svlogd's log")
    assert f"{name} up as md {nonce}" in log
    owners = kinds_lab.run(TERMUX_HOST, "ps -o user= -C runsv,svlogd", root=True)
    assert owners.stdout.split() == ["md", "md"], owners.stdout
    # termux-services' sv-disable: a `down` file and `sv down`.
    assert ssh(kinds_lab, TERMUX_HOST, f"sv-disable {name}").returncode == 0
    until(lambda: ssh(kinds_lab, TERMUX_HOST, f"sv status {name}").stdout.startswith("down:"),
          f"{name} down after sv-disable")
    # The same on a host without md's runsvdir fails.
    assert ssh(kinds_lab, SYSTEMD_HOST, f"sv status {name}").returncode != 0


def test_shared_ccache_opens_the_cache_to_every_build_user(tmp_path):
    """md builds on hosts without root share the lab's ccache with root's builds: entries root
    made before (0755 folders, 0644 files) become writable, and new ones are made so."""
    from meshdeploy.lab.core import shared_ccache

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a").chmod(0o755)
    entry = tmp_path / "a" / "b" / "x.o"
    entry.write_text("o")
    entry.chmod(0o644)
    (tmp_path / "ccache.conf").write_text("max_size = 5G\numask = 022\n")
    shared_ccache(tmp_path)
    assert (tmp_path / "ccache.conf").read_text() == "max_size = 5G\numask = 000\n"
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o777
    assert entry.stat().st_mode & 0o777 == 0o666
    entry.chmod(0o644)
    shared_ccache(tmp_path)  # once only: a cache already shared is left as it is
    assert entry.stat().st_mode & 0o777 == 0o644
