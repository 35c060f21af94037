"""services.ssh_forward: under network.transport: ssh, each orchestrator's OpenSSH forward to a
worker, supervised by its own service manager.

The lab inventory under ssh (node1 orchestrates node2 and node3): goldens of the three forms
(tests/golden/ssh/, MESHDEPLOY_UPDATE_GOLDEN=1 rewrites them), plans from facts (create, no-op,
update on a changed port, known after apply without the worker's login user, removal), and
ssh-forward.sh run for real by sh, as systemd and runit would start it, against a stub `ssh` on
PATH that records its arguments and plays the master, `-O check` and the nudge.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import accounts, golden, systemd_parse
from support.steps import decided
from support.require import needs
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.model import RUNIT, SYSTEMD_USER, Layout
from meshdeploy.core import account, shell
from meshdeploy.core.context import HostContext
from meshdeploy.errors import PlanError
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.services import forward
from meshdeploy.roles.services import operations as services
from meshdeploy.roles.services import orchestrator
from meshdeploy.roles.services.logs import log_sources

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "ssh"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
FLAGS = ["-m", "--host", "--port", "--rpc", "-ngl", "-ts", "-c", "-lm"]
TOOLS = {"sh": "/data/data/com.termux/files/usr/bin/sh",
         "svlogd": "/data/data/com.termux/files/usr/bin/svlogd"}
ACCOUNTS = {SYSTEMD_USER: accounts.SYSTEMD_USER, RUNIT: accounts.TERMUX}
LOGINS = {"node2": {"user": "md"}, "node3": {"user": "u0_a77"}}
FORMS = ["systemd", SYSTEMD_USER, RUNIT]


def ssh_lab(manager: str = "systemd", base: int | None = None, layout: Layout | None = None):
    """inventories/lab.yaml under network.transport: ssh: the rpc-servers on loopback, node1's
    llama-server reaching node2 and node3 through forwards; node1 rootless under `manager`."""
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    network = dataclasses.replace(cluster.network, transport="ssh")
    if base is not None:
        network = dataclasses.replace(network, ssh=dataclasses.replace(network.ssh,
                                                                       local_port_base=base))
    if manager != "systemd" and layout is None:
        layout = account.layout(account.parse("node1", ACCOUNTS[manager]))
    hosts = []
    for h in cluster.hosts:
        h = dataclasses.replace(h, rpc_servers=tuple(
            dataclasses.replace(r, bind="127.0.0.1") for r in h.rpc_servers))
        if h.name == "node1" and layout is not None:
            h = dataclasses.replace(h, rootless=True, layout=layout)
        hosts.append(h)
    return dataclasses.replace(cluster, network=network, hosts=tuple(hosts))


def context(cluster, units=None, name="node1", manager="systemd", logins=LOGINS,
            apply=False) -> HostContext:
    host = cluster.host(name)
    key = llama_cpp.build_key(cluster, host, COMMIT)
    facts = {"toolchain.Platform": {"kernel": "Linux", "tools": []},
             "llama_cpp.Builds": {"current": None, "builds": {key: {
                 "commit": COMMIT, "rpc_binary": "ggml-rpc-server", "flags": FLAGS}}},
             "services.Units": units or {}}
    if manager == RUNIT:
        facts["services.RunitTools"] = TOOLS
    others = {w: {"network.SshLogin": login} for w, login in logins.items()}
    ctx = HostContext(cluster, host, facts, run_values(commit=COMMIT, build_number=11312),
                      cluster_facts={name: facts, **others},
                      run_command=(lambda c: (True, [])) if apply else None)
    return decided(ctx, build_key=key)


def definition(step) -> str:
    """The unit file (or run script) a step writes, from its plan diff."""
    return "".join(line[1:] + "\n" for line in step.change.unit_diff.splitlines()[3:])


def installed(manager: str, cluster=None, worker="node2") -> dict:
    """The Units fact of node1 after the forward to `worker` was applied and runs."""
    cluster = cluster or ssh_lab(manager)
    ctx = context(cluster, manager=manager)
    step = forward.ssh_forward(ctx, worker)
    unit = f"meshdeploy-ssh-{worker}"
    have = {"active": "active", "enabled": "enabled", "content": definition(step),
            "started": 2, "written": 1}
    if manager == RUNIT:
        have["log"] = services.manager(ctx).log_run(unit)  # svlogd's log/run
    return {unit: have}


# -- what each manager renders -----------------------------------------------------------------

@pytest.mark.parametrize("manager", FORMS)
def test_golden(manager):
    cluster = ssh_lab(manager)
    step = forward.ssh_forward(context(cluster, manager=manager), "node2")
    golden.check(GOLDEN / f"{manager}-node1-node2.txt",
                 f"# {step.change.address}: {step.change.reason}\n"
                 + "\n# --- command\n".join(step.commands) + "\n")


def test_keys_are_the_forwarded_workers():
    cluster = ssh_lab()
    assert forward.keys(cluster) == ["node2", "node3"]
    plain = load_cluster(ROOT / "inventories" / "lab.yaml")
    assert forward.keys(plain) == []
    # node2 forwards to nobody: its slot is a no-op there.
    step = forward.ssh_forward(context(cluster, name="node2"), "node3")
    assert step.noop and "no forward to node3" in step.change.reason


def test_system_unit_runs_the_script_with_credentials():
    text = definition(forward.ssh_forward(context(ssh_lab()), "node2"))
    settings = dict(systemd_parse.settings(text))
    argv = systemd_parse.exec_argv(settings["ExecStart"])
    assert argv[:2] == ["/bin/sh", "-c"]
    assert argv[2] == str(shell.body(forward.SCRIPT))  # the template, byte for byte
    assert argv[3:] == ["ssh-forward", "${RUNTIME_DIRECTORY}/ctl",
                        "${CREDENTIALS_DIRECTORY}/key", "${CREDENTIALS_DIRECTORY}/known_hosts",
                        "22", "md", "10.200.0.12", "127.0.0.1:31000:127.0.0.1:50052"]
    assert "LoadCredential=key:/etc/meshdeploy/ssh/rpc_ed25519\n" in text
    assert "LoadCredential=known_hosts:/etc/meshdeploy/ssh/known_hosts\n" in text
    assert "RuntimeDirectory=meshdeploy-ssh-node2\n" in text
    assert "IPAddressDeny=any\nIPAddressAllow=localhost 10.200.0.12\n" in text
    assert "Restart=always\nRestartSec=2\n" in text and "StartLimitIntervalSec=0\n" in text


@pytest.mark.parametrize("manager", [SYSTEMD_USER, RUNIT])
def test_rootless_forms_read_the_users_files(manager):
    text = definition(forward.ssh_forward(context(ssh_lab(manager), manager=manager), "node2"))
    layout = ssh_lab(manager).host("node1").layout
    assert f"{layout.config}/ssh/rpc_ed25519" in text
    assert f"{layout.run}/ssh-node2.ctl" in text
    assert "CREDENTIALS_DIRECTORY" not in text and "DynamicUser" not in text
    if manager == RUNIT:
        assert text.startswith(f"#!{TOOLS['sh']}\n")
        assert f"exec {TOOLS['sh']} -c " in text


def test_hostile_paths_are_refused():
    """ssh expands % and ${} in its paths and unquotes -o values: such a path is refused."""
    layout = account.layout(account.parse("node1", ACCOUNTS[SYSTEMD_USER]))
    bad = dataclasses.replace(layout, config="/home/md/%d/.config/meshdeploy")
    with pytest.raises(PlanError, match="ssh would expand"):
        forward.ssh_forward(context(ssh_lab(SYSTEMD_USER, layout=bad), manager=SYSTEMD_USER),
                            "node2")
    with pytest.raises(PlanError, match="portable user name"):
        forward.ssh_forward(context(ssh_lab(), logins={"node2": {"user": "md -oProxy"}}),
                            "node2")


@needs("systemd-analyze")
@pytest.mark.parametrize("manager", ["systemd", SYSTEMD_USER])
def test_systemd_analyze_verifies_the_unit(manager, tmp_path):
    text = definition(forward.ssh_forward(context(ssh_lab(manager), manager=manager), "node2"))
    path = tmp_path / "meshdeploy-ssh-node2.service"
    path.write_text(text)
    done = subprocess.run(["systemd-analyze", "verify",
                           *(["--user"] if manager == SYSTEMD_USER else []), str(path)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)})
    complaints = [line for line in done.stderr.splitlines()
                  if "meshdeploy-ssh" in line or "Unknown" in line or "not valid" in line]
    assert done.returncode == 0 and not complaints, done.stderr


@needs("systemd-analyze")
def test_exposure_score(tmp_path):
    text = definition(forward.ssh_forward(context(ssh_lab()), "node2"))
    path = tmp_path / "meshdeploy-ssh-node2.service"
    path.write_text(text)
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(path)],
                         capture_output=True, text=True, timeout=60)
    score = float(out.stdout.rsplit("Overall exposure level for", 1)[1].split(":")[1].split()[0])
    assert score <= 1.5, out.stdout[-2000:]


# -- plans from facts ----------------------------------------------------------------------------

@pytest.mark.parametrize("manager", FORMS)
def test_create_then_noop(manager):
    cluster = ssh_lab(manager)
    step = forward.ssh_forward(context(cluster, manager=manager), "node2")
    assert step.change.action == "create"
    # Readiness: the forward's loopback port accepts within 20 s, and is the forward's own.
    assert "127.0.0.1 31000" in step.commands[-2] and " 20 " in step.commands[-2]
    assert "set -- 31000\n" in step.commands[-1]
    assert "held by" in step.commands[-1]
    again = forward.ssh_forward(context(cluster, installed(manager), manager=manager), "node2")
    assert again.noop, again.change


@pytest.mark.parametrize("manager", FORMS)
def test_a_changed_port_updates_and_restarts(manager):
    moved = ssh_lab(manager, base=52000)
    step = forward.ssh_forward(context(moved, installed(manager), manager=manager), "node2")
    assert step.change.action == "update"
    assert "-127.0.0.1:31000:127.0.0.1:50052" in step.change.unit_diff.replace("\"", "") or \
        "31000" in step.change.unit_diff
    assert any("52000" in c for c in step.commands)


def test_a_changed_user_updates():
    units = installed("systemd")
    step = forward.ssh_forward(context(ssh_lab(), units, logins={"node2": {"user": "other"}}),
                               "node2")
    assert step.change.action == "update" and "other" in step.change.unit_diff


def test_without_the_workers_login_user_known_after_apply():
    step = forward.ssh_forward(context(ssh_lab(), logins={}), "node2")
    assert step.change.action == "create" and not step.commands
    assert any(d.known_after_apply and d.name == "user" for d in step.change.diffs)
    # apply with the fact still missing: a clear failure, never a forward without a user.
    failed = forward.ssh_forward(context(ssh_lab(), logins={}, apply=True), "node2")
    assert failed.commands and "login user" in failed.commands[0]


def test_stale_forward_is_removed_and_a_forwarded_one_kept():
    units = installed("systemd")
    kept = services.stale_units(context(ssh_lab(), units))
    assert kept.noop
    plain = load_cluster(ROOT / "inventories" / "lab.yaml")
    gone = services.stale_units(context(plain, units))
    assert gone.change.action == "delete"
    assert any("meshdeploy-ssh-node2" in c for c in gone.commands)


def test_destroy_names_the_forward():
    teardown = services.destroy(context(ssh_lab(), installed("systemd")), False)
    assert [s.change.resource for s in teardown.steps] == ["ssh_forward[node2]"]


def test_macos_is_refused_at_preflight():
    ctx = context(ssh_lab())
    ctx.facts["toolchain.Platform"] = {"kernel": "Darwin", "tools": []}
    with pytest.raises(PlanError, match="not yet on"):
        forward.preflight(ctx)
    forward.preflight(context(ssh_lab()))  # Linux: passes


# -- llama-server and rpc-server under ssh ------------------------------------------------------

def test_llama_server_waits_for_its_forwards_and_checks_through_them():
    cluster = ssh_lab()
    ctx = context(cluster)
    step = orchestrator.llama_server(ctx, "main")
    text = step.change.unit_diff
    for worker in ("node2", "node3"):
        assert f"+After=meshdeploy-ssh-{worker}.service" in text
        assert f"+Wants=meshdeploy-ssh-{worker}.service" in text
    # The worker checks dial the forward's loopback ports, not the rpc-servers' own port.
    checks = [c for c in step.commands if "tcp-wait" in c]
    assert any("127.0.0.1 31000" in c for c in checks)
    assert any("127.0.0.1 31001" in c for c in checks)
    assert not any("127.0.0.1 50052" in c for c in checks)


def test_llama_server_user_unit_waits_for_the_forwards():
    ctx = context(ssh_lab(SYSTEMD_USER), manager=SYSTEMD_USER)
    text = orchestrator.llama_server(ctx, "main").change.unit_diff
    assert "+After=meshdeploy-ssh-node2.service\n+Wants=meshdeploy-ssh-node2.service" in text


def test_llama_server_restarts_after_its_forward_restarted():
    cluster = ssh_lab()
    units = installed("systemd")
    ctx = context(cluster, units)
    server = orchestrator.llama_server(context(cluster), "main")
    want = definition(server)
    units["meshdeploy-server-main"] = {"active": "active", "enabled": "enabled",
                                       "content": want, "started": 2, "written": 1}
    ctx = context(ssh_lab(base=52000), units)
    ctx.steps.add("node1", "services.ssh_forward[node2]",
                  forward.ssh_forward(ctx, "node2"))
    step = orchestrator.llama_server(ctx, "main")
    assert step.change.action == "update"


def test_rpc_server_allows_the_workers_own_sshd():
    """Under ssh a forwarded connection comes from sshd on the worker: localhost."""
    ctx = context(ssh_lab(), name="node2")
    text = services.rpc_server(ctx, 50052).change.unit_diff
    assert "+IPAddressAllow=127.0.0.1 localhost" in text or \
        "+IPAddressAllow=localhost 127.0.0.1" in text
    assert "10.200.0.11" not in text


def test_logs_include_the_forwards():
    sources = [s for s in log_sources(ssh_lab()) if s.service.startswith("ssh-forward")]
    assert [(s.host, s.unit) for s in sources] == [("node1", "meshdeploy-ssh-node2"),
                                                   ("node1", "meshdeploy-ssh-node3")]


# -- ssh-forward.sh run for real against a stub ssh ---------------------------------------------

# The stub: every call's argv, NUL-separated, one line per call; the master (-M) makes the
# control socket's file and runs until $DIR/stop appears (then exits 7) or TERM (exits 143);
# `-O check` answers 0 once that file exists; the nudge exits $NUDGE_RC (the forced command's 1).
STUB = r"""#!/bin/sh
# Each call's line goes to the log in one write (cat of a file of its own): two calls written
# piecewise at once interleaved into one line under load.
one="$STUB_DIR/call.$$"
{ printf '%s\0' "$@"; echo; } > "$one"
cat "$one" >> "$STUB_DIR/calls"
rm -f "$one"
case " $* " in
  *" -M "*)
    trap 'echo term >> "$STUB_DIR/master"; exit 143' TERM
    ctl=; prev=
    for a do [ "$prev" = -S ] && ctl=$a; prev=$a; done
    : > "$ctl"
    echo "$$" > "$STUB_DIR/master.pid"
    while [ ! -e "$STUB_DIR/stop" ]; do sleep 0.1; done
    exit 7 ;;
  *" -O check "*)
    ctl=; prev=
    for a do [ "$prev" = -S ] && ctl=$a; prev=$a; done
    [ -e "$ctl" ] ;;
  *" nudge "*) exit "${NUDGE_RC:-1}" ;;
  *" -O forward "*)
    # $STUB_DIR/forward-rc holds each answer in turn (then 0): 255 is sshd's refusal
    rc=$(head -n 1 "$STUB_DIR/forward-rc" 2>/dev/null)
    [ -f "$STUB_DIR/forward-rc" ] && sed -i 1d "$STUB_DIR/forward-rc"
    if [ "${rc:-0}" != 0 ]; then
      echo "remote port forwarding failed for listen port 50181" >&2
    fi
    exit "${rc:-0}" ;;
esac
"""


def stub_env(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(STUB)
    (bin_dir / "ssh").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "STUB_DIR": str(tmp_path)}


def calls(tmp_path) -> list[list[str]]:
    text = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    return [line.split("\0")[:-1] for line in text.splitlines()]


def master_call(tmp_path) -> list[str]:
    """The master's argv (it and the first `-O check` race to the log)."""
    return next(c for c in calls(tmp_path) if "-M" in c)


def wait_for(predicate, seconds=15):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def master_argv(ctl, key, known, user="md", addr="10.200.0.12", port="22",
                forwards=("-L", "127.0.0.1:31000:127.0.0.1:50052")) -> list[str]:
    """The spec's command line (network.transport: ssh)."""
    return [*common_options(key, known, user, port), "-N", "-M", "-S", ctl,
            "-o", "ControlPersist=no", "-o", "ExitOnForwardFailure=yes", *forwards, addr]


def common_options(key, known, user="md", port="22") -> list[str]:
    """What every ssh of the script is given: the key alone, the pinned host keys, no prompt."""
    return ["-F", "none", "-i", key, "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none",
            "-o", "BatchMode=yes",
            "-o", f'UserKnownHostsFile="{known}"', "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", "StrictHostKeyChecking=yes", "-o", "UpdateHostKeys=no",
            "-o", "Ciphers=aes128-gcm@openssh.com,chacha20-poly1305@openssh.com",
            "-o", "Compression=no", "-o", "ServerAliveInterval=1", "-o", "ServerAliveCountMax=3",
            "-o", "ConnectTimeout=10", "-p", port, "-l", user]


def spaced_layout(tmp_path) -> Layout:
    home = tmp_path / "a home"
    return Layout(prefix=f"{home}/.local/share/meshdeploy", cache=f"{home}/.cache/meshdeploy",
                  run=f"{home}/run dir/meshdeploy", services=f"{home}/.config/systemd/user",
                  manager=SYSTEMD_USER, home=str(home), config=f"{home}/.config/meshdeploy",
                  user="md")


def user_unit_argv(tmp_path) -> tuple[list[str], Layout]:
    layout = spaced_layout(tmp_path)
    cluster = ssh_lab(SYSTEMD_USER, layout=layout)
    text = definition(forward.ssh_forward(context(cluster, manager=SYSTEMD_USER), "node2"))
    argv = systemd_parse.exec_argv(dict(systemd_parse.settings(text))["ExecStart"])
    return argv, layout


def test_script_runs_the_specs_master_then_the_nudge(tmp_path):
    """The user unit's ExecStart as systemd splits it, run by sh: paths with a space arrive
    whole, the master gets exactly the spec's options, the nudge goes through its socket, and
    the script ends with the master's status."""
    argv, layout = user_unit_argv(tmp_path)
    env = stub_env(tmp_path)
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert wait_for(lambda: any("nudge" in c for c in calls(tmp_path))), calls(tmp_path)
    (tmp_path / "stop").touch()
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 7, err
    assert err == ""  # the nudge's exit 1 is the expected answer
    ctl = f"{layout.run}/ssh-node2.ctl"
    made = calls(tmp_path)
    key, known = f"{layout.config}/ssh/rpc_ed25519", f"{layout.config}/ssh/known_hosts"
    assert master_call(tmp_path) == master_argv(ctl, key, known)
    # The check and the nudge carry the master's options: were the master gone, the nudge's
    # own connection would log in with this key alone and check the pinned host key.
    assert [*common_options(key, known), "-S", ctl, "-O", "check", "10.200.0.12"] in made
    assert made[-1] == [*common_options(key, known), "-S", ctl, "-o", "ControlMaster=no", "-T",
                        "-n", "10.200.0.12", "nudge"]


def test_system_unit_argv_runs_too(tmp_path):
    """The system unit's ExecStart, with what systemd puts in its variables."""
    text = definition(forward.ssh_forward(context(ssh_lab()), "node2"))
    words = systemd_parse.exec_argv(dict(systemd_parse.settings(text))["ExecStart"])
    run, creds = tmp_path / "run", tmp_path / "creds"
    argv = [w.replace("${RUNTIME_DIRECTORY}", str(run))
            .replace("${CREDENTIALS_DIRECTORY}", str(creds))
            if isinstance(w, systemd_parse.Expansion) else w for w in words]
    argv[2] = words[2]  # the script's own $ words are not systemd's
    env = stub_env(tmp_path)
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: any("nudge" in c for c in calls(tmp_path)))
    (tmp_path / "stop").touch()
    assert proc.wait(timeout=15) == 7
    assert master_call(tmp_path) == master_argv(str(run / "ctl"), str(creds / "key"),
                                             str(creds / "known_hosts"))


def test_term_stops_the_master(tmp_path):
    argv, _ = user_unit_argv(tmp_path)
    proc = subprocess.Popen(argv, env=stub_env(tmp_path), stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: any("nudge" in c for c in calls(tmp_path)))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 143
    assert (tmp_path / "master").read_text() == "term\n"


def test_an_unexpected_nudge_status_is_logged(tmp_path):
    argv, _ = user_unit_argv(tmp_path)
    env = {**stub_env(tmp_path), "NUDGE_RC": "255"}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: any("nudge" in c for c in calls(tmp_path)))
    (tmp_path / "stop").touch()
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 7
    assert "nudge session to 10.200.0.12 exited 255" in err


def test_a_master_that_never_answers_is_given_up(tmp_path):
    """A master whose socket never answers (-O check fails) is stopped after ~10 s."""
    argv, _ = user_unit_argv(tmp_path)
    env = stub_env(tmp_path)
    stub = Path(env["PATH"].split(":")[0]) / "ssh"
    stub.write_text(STUB.replace('[ -e "$ctl" ] ;;', "exit 255 ;;"))
    start = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "did not answer" in proc.stderr
    assert 9 <= time.monotonic() - start < 20


def test_runit_run_script_runs(tmp_path):
    """The runit `run` file itself, run by sh (its #! names the host's sh)."""
    layout = dataclasses.replace(spaced_layout(tmp_path), manager=RUNIT)
    cluster = ssh_lab(RUNIT, layout=layout)
    ctx = context(cluster, manager=RUNIT)
    ctx.facts["services.RunitTools"] = {"sh": "/bin/sh", "svlogd": "/usr/bin/svlogd"}
    run = tmp_path / "run"
    run.write_text(definition(forward.ssh_forward(ctx, "node2")))
    subprocess.run(["sh", "-n", str(run)], check=True)
    proc = subprocess.Popen(["sh", str(run)], env=stub_env(tmp_path), stdout=subprocess.PIPE,
                            text=True)
    assert wait_for(lambda: any("nudge" in c for c in calls(tmp_path)))
    (tmp_path / "stop").touch()
    assert proc.wait(timeout=15) == 7
    call = master_call(tmp_path)
    assert call[call.index("-S") + 1] == f"{layout.run}/ssh-node2.ctl"


def test_a_debian_orchestrator_with_forwards_gets_nss_systemd():
    """ssh exits ("No user exists for uid ...") when it cannot look up its DynamicUser, which
    only nss-systemd names: a Debian orchestrator with forwards installs libnss-systemd (found
    missing in the lab's minimal Debian: the forward restarted for ever); its workers and a
    cluster without forwards do not."""
    from meshdeploy.roles.toolchain.operations import wanted_packages

    cluster = ssh_lab()
    assert "libnss-systemd" in wanted_packages(cluster, "apt", cluster.host("node1"))
    assert "libnss-systemd" not in wanted_packages(cluster, "apt", cluster.host("node2"))
    plain = load_cluster(ROOT / "inventories" / "lab.yaml")
    assert "libnss-systemd" not in wanted_packages(plain, "apt", plain.host("node1"))
    rootless = ssh_lab(SYSTEMD_USER)  # a user manager's units need no dynamic user
    assert "libnss-systemd" not in wanted_packages(rootless, "apt", rootless.host("node1"))


def test_the_reverse_end_is_asked_of_the_running_master_and_retried(tmp_path):
    """A worker that gets model bytes from this host: its R= value is not on the master's
    command line (ExitOnForwardFailure would end the RPC ports with it when the worker's port is
    taken) but asked through the socket once the master answers; a refusal is logged once,
    leaves the master up, and is asked again until it holds, which is logged once."""
    ctl, key, known = str(tmp_path / "ctl"), "/k", "/kh"
    (tmp_path / "forward-rc").write_text("255\n255\n")
    env = stub_env(tmp_path)
    script = forward.SCRIPT.read_text().replace("sleep 10 &", "sleep 0.2 &")
    proc = subprocess.Popen(["sh", "-c", script, "ssh-forward", ctl, key, known, "22", "md",
                             "10.200.0.12", "127.0.0.1:31000:127.0.0.1:50052",
                             "R=127.0.0.1:50181:127.0.0.1:50180"],
                            env=env, stderr=subprocess.PIPE, text=True)
    asked = lambda: [c for c in calls(tmp_path) if "forward" in c and "-O" in c]  # noqa: E731
    assert wait_for(lambda: len(asked()) >= 4)
    (tmp_path / "stop").touch()
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == 7, err
    assert master_call(tmp_path) == master_argv(ctl, key, known)  # no -R there
    assert asked()[0] == [*common_options(key, known), "-S", ctl, "-O", "forward", "-R",
                          "127.0.0.1:50181:127.0.0.1:50180", "10.200.0.12"]
    assert err.count("failed (tried again every 10 s; the RPC ports are not affected)") == 1
    assert err.count("the reverse end 127.0.0.1:50181:127.0.0.1:50180 to 10.200.0.12 holds") == 1
    assert err.index("failed") < err.index("holds")


def test_status_rows_of_the_forwards_run_for_real(tmp_path, monkeypatch):
    """The status probe as a runit orchestrator runs it (a stub `sv` answers for the units):
    node2's forward runs and its port accepts (a real listener), node3's runs but nothing
    listens on its port: that one is unhealthy."""
    import socket

    layout = dataclasses.replace(spaced_layout(tmp_path), manager=RUNIT)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    closed_port = free.getsockname()[1]
    free.close()
    base = listener.getsockname()[1]
    cluster = ssh_lab(RUNIT, layout=layout, base=base)
    forwards = {f.worker.name: f for f in cluster.ssh_forwards(cluster.host("node1"))}
    assert forwards["node2"].ports[0][0] == base
    monkeypatch.setattr(type(cluster), "ssh_forwards", lambda self, host: [
        # node3's forward on a port nothing listens on
        forwards["node2"], dataclasses.replace(forwards["node3"], ports=((closed_port, 50052),))])
    probe = forward.status(cluster, cluster.host("node1"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sv").write_text('#!/bin/sh\necho "run: $2: (pid 1) 5s"\n')
    (bin_dir / "sv").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    try:
        out = subprocess.run(["sh", "-c", probe.script], env=env, capture_output=True,
                             text=True, timeout=30)
        # The probe read the socket table and connected to nothing: a connect to ssh's
        # listener would reach the worker's rpc-server through the forward and wait in its
        # one-place backlog (nothing waits to be accepted here).
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert out.returncode == 0, out.stderr
    rows = {r.service: r for r in probe.parse(out.stdout.splitlines())}
    assert rows["ssh-forward node2"].healthy and rows["ssh-forward node2"].unit == "active"
    assert rows["ssh-forward node2"].answer == "1/1 loopback ports listening"
    assert not rows["ssh-forward node3"].healthy
    assert rows["ssh-forward node3"].answer == "0/1 loopback ports listening"
    # Where no socket table can be read the unit's state alone counts, and no connect is made.
    (row,) = [r for r in probe.parse(["forward node2 active ?/1"]) if r.service.endswith("2")]
    assert row.healthy and "not checked" in row.answer
    # A host's stray line names no forward of the file; a missing line is a row of its own.
    rows = probe.parse(["forward nodeX active 1/1", "forward node2 active 1/1"])
    assert [(r.service, r.healthy) for r in rows] == [("ssh-forward node2", True),
                                                     ("ssh-forward node3", False)]


def _listener_as(user: str | None):
    """A process listening on a free loopback port, as `user` (None: this one's), and its port."""
    code = ("import socket, sys, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\n"
            "s.listen()\nprint(s.getsockname()[1], flush=True)\ntime.sleep(60)\n")
    argv = ["/usr/bin/python3", "-c", code]
    if user is not None:
        argv = ["setpriv", f"--reuid={pwd_uid(user)}", "--regid=65534", "--clear-groups", *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def _owner_check(manager: str, port: int) -> subprocess.CompletedProcess:
    """forward.owner_check of node1's forward to node2 on `port`, run by sh."""
    fwd = forward.SshForward(load_cluster(ROOT / "inventories" / "lab.yaml").host("node2"),
                             ((port, 50052),))
    mgr = services.manager(context(ssh_lab(manager), manager=manager))
    return subprocess.run(["sh", "-c", forward.owner_check(mgr, "meshdeploy-ssh-node2",
                                                           "node1/u", fwd)],
                          capture_output=True, text=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a listener of another uid)")
@needs("ss")
def test_a_port_another_user_took_first_is_not_taken_for_the_forward(tmp_path):
    """A local user who binds the forward's port while the forward is down would be sent
    llama-server's tensors: the TCP readiness alone accepts that listener (shown), the owner
    check refuses it, by uid under runit and by cgroup under systemd; the user's own listener
    passes under runit."""
    squatter, port = _listener_as("nobody")
    try:
        ready = subprocess.run(["sh", "-c", services.tcp_wait("127.0.0.1", port, 3, None, "t")])
        assert ready.returncode == 0  # the attack: readiness is satisfied by anyone's listener
        check = _owner_check(RUNIT, port)
        assert check.returncode == 1 and f"held by uid {pwd_uid('nobody')}" in check.stderr, (
            check.stderr)
        check = _owner_check("systemd", port)
        assert check.returncode == 1 and "not by the forward" in check.stderr, check.stderr
    finally:
        squatter.kill()
    own, port = _listener_as(None)  # runit: the login user's own listener (here root's)
    try:
        check = _owner_check(RUNIT, port)
        assert check.returncode == 0, check.stderr
    finally:
        own.kill()


def pwd_uid(name: str) -> int:
    import pwd

    return pwd.getpwnam(name).pw_uid
