"""The services role on rootless hosts: systemd --user units and runit service folders.

The lab inventory's worker node2 (and orchestrator node1) made rootless under each manager:
goldens of what they get (tests/golden/rootless/, MESHDEPLOY_UPDATE_GOLDEN=1 rewrites them),
plans from facts (create, no-op, update, restart, remove), and the real things where this
machine has them: `systemd-analyze verify --user` of the units, the runit `run` script run by
sh against a stub binary, and runit itself (runsvdir over a temporary folder, as an unprivileged
user) driven by the Runit manager's own commands and read back by the Units fact.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from support import golden
from support.steps import decided
from support.require import needs, require
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.model import RUNIT, SYSTEMD_USER
from meshdeploy.config.sources import HfFile, HfResolved
from meshdeploy.core import account
from meshdeploy.core.context import HostContext
from meshdeploy.errors import PlanError
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.services import operations as services
from meshdeploy.roles.services import orchestrator
from meshdeploy.roles.services.facts import KeyFile, RunitTools, Units
from meshdeploy.roles.services.managers import Runit, SystemdUser

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "rootless"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
FLAGS = ["-m", "--host", "--port", "--rpc", "-ngl", "-ts", "-c", "-lm", "--api-key-file"]
TOOLS = {"sh": "/data/data/com.termux/files/usr/bin/sh",
         "svlogd": "/data/data/com.termux/files/usr/bin/svlogd"}
ACCOUNTS = {
    SYSTEMD_USER: ["home=/home/md", "user=md", "uid=1000", "systemd_user=running",
                   "linger=yes", "runtime=/run/user/1000"],
    RUNIT: ["home=/data/data/com.termux/files/home", "user=u0_a123", "uid=10123", "sv=yes",
            "runsvdir=runsvdir -P /data/data/com.termux/files/usr/var/service", "termux_prefix=/data/data/com.termux/files/usr"],
}
MANAGERS = [SYSTEMD_USER, RUNIT]


def rootless_lab(manager: str, cache: bool = True, hosts=("node1", "node2")):
    """inventories/lab.yaml with `hosts` rootless under `manager` (node2's worker caching)."""
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    found = account.layout(account.parse("x", ACCOUNTS[manager]))
    out = []
    for h in cluster.hosts:
        if h.name == "node2":
            h = dataclasses.replace(h, rpc_servers=tuple(
                dataclasses.replace(r, cache=cache) for r in h.rpc_servers))
        if h.name in hosts:
            h = dataclasses.replace(h, rootless=True, layout=found)
        out.append(h)
    return dataclasses.replace(cluster, hosts=tuple(out))


def context(cluster, name: str, units=None, manager: str = RUNIT, **facts) -> HostContext:
    host = cluster.host(name)
    key = llama_cpp.build_key(cluster, host, COMMIT)
    resolved = run_values(commit=COMMIT, build_number=11312, models={})
    for model, spec in cluster.models.items():
        files = getattr(spec.source, "files", ())
        if files:
            hub = resolved.value("models", "models")
            hub[model] = HfResolved(spec.source.repo, "f" * 40, tuple(
                HfFile(f, 1, "a" * 64, f"https://hf.example/{f}") for f in files))
    base = {"toolchain.Platform": {"kernel": "Linux", "tools": []},
            "llama_cpp.Builds": {"current": None, "builds": {key: {
                "commit": COMMIT, "rpc_binary": "ggml-rpc-server", "flags": FLAGS}}},
            "services.Units": units or {}}
    if manager == RUNIT:
        base["services.RunitTools"] = TOOLS
    base.update(facts)
    return decided(HostContext(cluster, host, base, resolved), build_key=key)


def wanted(manager: str, name: str = "node2") -> str:
    """The definition the step writes: the unit file, or the runit run script."""
    cluster = rootless_lab(manager)
    ctx = context(cluster, name, manager=manager)
    mgr = services.manager(ctx)
    step = services.rpc_server(ctx, 50052) if name == "node2" else \
        orchestrator.llama_server(ctx, "main")
    unit = "meshdeploy-rpc-50052" if name == "node2" else "meshdeploy-server-main"
    text = step.change.unit_diff
    assert text.startswith(f"--- {mgr.label(unit)} (host)")
    return "".join(line[1:] + "\n" for line in text.splitlines()[3:])


# -- what each manager renders ----------------------------------------------------------------

@pytest.mark.parametrize("manager", MANAGERS)
@pytest.mark.parametrize("name", ["node1", "node2"])
def test_golden(manager, name):
    cluster = rootless_lab(manager)
    ctx = context(cluster, name, manager=manager)
    step = services.rpc_server(ctx, 50052) if name == "node2" else \
        orchestrator.llama_server(ctx, "main")
    golden.check(GOLDEN / f"{manager}-{name}.txt",
                 f"# {step.change.address}: {step.change.reason}\n"
                 + "\n# --- command\n".join(step.commands) + "\n")


def test_hosts_with_root_keep_their_system_units():
    """The same file with node2 rootless: node1 (root) renders what it always did."""
    plain = load_cluster(ROOT / "inventories" / "lab.yaml")
    mixed = rootless_lab(SYSTEMD_USER, cache=False, hosts=("node2",))
    a = orchestrator.llama_server(context(plain, "node1", manager=""), "main")
    b = orchestrator.llama_server(context(mixed, "node1", manager=""), "main")
    assert a.commands == b.commands
    assert "DynamicUser=yes" in a.change.unit_diff
    assert isinstance(services.manager(context(mixed, "node2", manager=SYSTEMD_USER)),
                      SystemdUser)


def test_user_unit_has_nothing_a_user_manager_cannot_do():
    unit = wanted(SYSTEMD_USER)
    for setting in ("DynamicUser", "User=", "CacheDirectory", "LoadCredential",
                    "SupplementaryGroups", "IPAddressDeny", "ProtectSystem", "PrivateTmp"):
        assert f"\n{setting}" not in unit, setting
    layout = rootless_lab(SYSTEMD_USER).host("node2").layout
    assert f"Environment=LLAMA_CACHE={layout.cache}/meshdeploy-rpc-50052\n" in unit
    assert "Restart=always\nRestartSec=2\nNoNewPrivileges=yes\n" in unit
    assert unit.rstrip().endswith("WantedBy=default.target")
    assert "-H 10.200.0.12 -p 50052" in unit  # binds what the file says


@needs("systemd-analyze")
@pytest.mark.parametrize("name", ["node1", "node2"])
def test_systemd_analyze_verifies_the_user_unit(name, tmp_path):
    unit = "meshdeploy-rpc-50052" if name == "node2" else "meshdeploy-server-main"
    text = wanted(SYSTEMD_USER, name)
    # The binary must exist for verify: the unit's ExecStart names the build's path.
    program = text.split("ExecStart=", 1)[1].split()[0]
    fake = tmp_path / "root" / program.lstrip("/")
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    path = tmp_path / f"{unit}.service"
    path.write_text(text.replace(program, str(fake)))
    done = subprocess.run(["systemd-analyze", "verify", "--user", str(path)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)})
    complaints = [line for line in done.stderr.splitlines()
                  if unit in line or "Unknown" in line or "not valid" in line]
    assert done.returncode == 0 and not complaints, done.stderr


# -- the runit run script, run for real --------------------------------------------------------

HOSTILE = "it's a \"test\" $HOME `id` $(id) \\ end"


def test_run_script_hands_the_binary_exactly_its_argv(tmp_path):
    cluster = rootless_lab(RUNIT)
    server = dataclasses.replace(cluster.servers[0], extra_args=("--alias", HOSTILE))
    cluster = dataclasses.replace(cluster, servers=(server,))
    ctx = context(cluster, "node1", manager=RUNIT,
                  **{"services.RunitTools": {"sh": "/bin/sh", "svlogd": "/usr/bin/svlogd"}})
    run = wanted_from(ctx)
    program = run.rsplit("\nexec ", 1)[1].split()[0].strip("'")
    stub = tmp_path / "stub"
    stub.write_text('#!/bin/sh\nfor a; do printf "%s\\0" "$a"; done\n'
                    'printf "env=%s\\0" "$MESHDEPLOY_MODEL_SHA256"; echo err >&2\n')
    stub.chmod(0o755)
    script = tmp_path / "run"
    assert program.startswith("/") and f"exec {program} " in run
    script.write_text(run.replace(f"exec {program} ", f"exec {stub} ", 1))
    script.chmod(0o700)
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
    done = subprocess.run([str(script)], capture_output=True, timeout=30, cwd=tmp_path)
    words = done.stdout.split(b"\0")
    assert words[-1] == b"err\n"  # exec 2>&1: stderr joins stdout, for svlogd
    words = [w.decode() for w in words[:-1]]
    assert words[-1] == "env=" + "a" * 64
    assert words[:-1][-2:] == ["--alias", HOSTILE]
    assert words[0] == "-m" and "--rpc" in words
    assert not (tmp_path / "pwned").exists()


def wanted_from(ctx) -> str:
    step = orchestrator.llama_server(ctx, "main")
    return "".join(line[1:] + "\n" for line in step.change.unit_diff.splitlines()[3:])


def test_a_run_script_refuses_an_sh_it_cannot_name():
    cluster = rootless_lab(RUNIT)
    ctx = context(cluster, "node2", manager=RUNIT,
                  **{"services.RunitTools": {"sh": None, "svlogd": "/x"}})
    with pytest.raises(PlanError, match="no sh on PATH"):
        services.rpc_server(ctx, 50052)
    with pytest.raises(PlanError, match="need sh on the login user's PATH"):
        services.preflight(ctx)


# -- plans from facts --------------------------------------------------------------------------

def have(manager: str, content: str, active="active", enabled="enabled", log=None, **more):
    unit = {"active": active, "enabled": enabled, "content": content, "started": None,
            "written": None, **more}
    if manager == RUNIT:
        unit["log"] = log
    return unit


@pytest.mark.parametrize("manager", MANAGERS)
def test_create_noop_update_restart_and_remove(manager):
    cluster = rootless_lab(manager)
    unit = "meshdeploy-rpc-50052"
    want = wanted(manager)
    ctx = context(cluster, "node2", manager=manager)
    log = services.manager(ctx).log_run(unit) if manager == RUNIT else None

    def plan(units, **kw):
        return services.rpc_server(context(cluster, "node2", units, manager, **kw), 50052)

    created = plan({})
    assert created.change.action == "create"
    layout = cluster.host("node2").layout
    assert created.commands[0] == f"mkdir -p {layout.cache}/meshdeploy-rpc-50052 && " \
                                  f"chmod 700 {layout.cache}/meshdeploy-rpc-50052"
    same = plan({unit: have(manager, want, log=log)})
    assert same.change.action == "no-op" and same.commands == []
    changed = plan({unit: have(manager, want.replace("50052 ", "50052 -t 2 ", 1), log=log)})
    assert changed.change.action == "update"
    assert changed.change.reason == "unit file differs; restart"
    stopped = plan({unit: have(manager, want, "inactive", "disabled", log=log)})
    assert stopped.change.reason == "inactive/disabled: start it"
    written = plan({unit: have(manager, want, log=log, started=100, written=200)})
    assert "written after the running process started" in written.change.reason
    if manager == RUNIT:
        old_log = plan({unit: have(manager, want, log="#!/bin/sh\nexec cat\n")})
        assert old_log.change.action == "update"
        assert "runit-up" not in " ".join(stopped.commands)
        assert any('sv -w "$WAIT" restart "$DIR"' in c for c in stopped.commands)
        assert "svlogd -tt" in created.commands[3]
    else:
        assert "systemctl --user enable --no-reload --quiet meshdeploy-rpc-50052" in \
            stopped.commands[1]
    # Gone from the file: removed, with its log folder on runit.
    stale = services.stale_units(context(cluster, "node2", {
        unit: have(manager, want, log=log), "meshdeploy-rpc-50053": have(manager, "x")},
        manager))
    assert stale.change.action == "delete" and "meshdeploy-rpc-50053" in stale.commands[0]
    if manager == RUNIT:
        assert stale.commands[0].count("sv exit") == 2 and len(stale.commands) == 1
    else:
        assert stale.commands[-1] == "systemctl --user daemon-reload"
    gone = services.destroy(context(cluster, "node2", {unit: have(manager, want, log=log)},
                                    manager), purge=False)
    (step,) = gone.steps
    assert step.change.action == "delete"
    if manager == SYSTEMD_USER:
        assert step.commands[1].startswith("systemctl --user daemon-reload && systemctl --user "
                                           "reset-failed meshdeploy-rpc-50052")


@pytest.mark.parametrize("manager", MANAGERS)
def test_orchestrator_waits_for_workers_and_health_through_its_manager(manager):
    step = orchestrator.llama_server(context(rootless_lab(manager), "node1", manager=manager),
                                     "main")
    text = "\n".join(step.commands)
    assert step.commands[0].startswith("systemctl --user stop" if manager == SYSTEMD_USER
                                       else "sv -w 15 down")
    assert "tcp-wait" in step.commands[1]
    shim = 'systemctl() { command systemctl --user "$@"; }' if manager == SYSTEMD_USER \
        else "systemctl() { return 1; }"
    assert shim in step.commands[-1]
    assert ("journalctl --user -u meshdeploy-server-main" in text) == (manager == SYSTEMD_USER)
    assert ("/log/meshdeploy-server-main/current" in text) == (manager == RUNIT)


@pytest.mark.parametrize("manager", MANAGERS)
def test_md_failover_on_a_rootless_host_keeps_its_state_outside_the_runtime_folder(manager):
    """A rootless orchestrator that may lose a worker runs md-failover. Its state file and the
    socket llama-server listens on behind it were in $XDG_RUNTIME_DIR/meshdeploy, which the
    systemd --user unit's sandbox hides whole (InaccessiblePaths=%t): md-failover died at its
    first start (EACCES), seen on the rootless lab. They live in a folder of the user's cache,
    the one folder the unit may write, made 0700 before the unit starts."""
    from meshdeploy.placement.failover import Run
    from meshdeploy.roles.services import failover
    from meshdeploy.roles.rpc_cache import run as rpc_cache_run

    cluster = rootless_lab(manager, cache=False, hosts=("node1",))
    ctx = context(cluster, "node1", manager=manager,
                  **{"services.UserNamespaces": True} if manager == SYSTEMD_USER else {})
    layout = object()  # the argv reads each run's lost, rpc and split; a layout only if any
    runs = (Run((), ("node2:50052", "node3:50052"), None, layout),
            Run(("node2",), ("node3:50052",), None, layout),
            Run(("node3",), ("node2:50052",), None, layout))
    ctx.resolved = ctx.resolved.fixed(rpc_cache_run.ROLE, rpc_cache_run.Run(
        failover={"main": runs}))
    step = orchestrator.llama_server(ctx, "main")
    folder = failover.folder(cluster.host("node1"), cluster.server("main"))
    home = ACCOUNTS[manager][0].split("=", 1)[1]
    assert folder == f"{home}/.cache/meshdeploy/meshdeploy-server-main"
    text = "".join(line[1:] + "\n" for line in step.change.unit_diff.splitlines()[3:])
    assert "md-failover-" in text and f"--state {folder}/failover.json" in text, text
    assert "/run/user/" not in text.replace("InaccessiblePaths=%t", "")
    if manager == SYSTEMD_USER:
        assert f"ReadWritePaths={folder}\n" in text and "InaccessiblePaths=%t\n" in text
    assert step.commands[0] == f"mkdir -p {folder} && chmod 700 {folder}", step.commands
    # ... and again at every start, before the sandbox needs it: a user who empties ~/.cache
    # left a systemd --user unit failing (226/NAMESPACE) and md-failover unable to write its
    # state until the next apply (the rootless lab's test removes the folder and restarts).
    made = (f"ExecStartPre=+/bin/mkdir -p -m 700 {folder}\n" if manager == SYSTEMD_USER
            else f"mkdir -p -m 700 {folder}\nexec ")
    assert made in text, text


@pytest.mark.parametrize("manager", MANAGERS)
def test_md_failovers_folder_goes_with_its_server_unit(manager):
    """A server that leaves a rootless host (moved elsewhere, or destroy) takes md-failover's
    folder in the user's cache with it; the rootless lab's destroy test found it left behind.
    On a host with root the unit's RuntimeDirectory goes by itself: nothing to remove."""
    cluster = rootless_lab(manager, hosts=("node2",))
    unit = "meshdeploy-server-gone"
    folder = f"{cluster.host('node2').layout.cache}/{unit}"
    units = {unit: have(manager, "x")}
    stale = services.stale_units(context(cluster, "node2", units, manager))
    assert f"rm -rf -- {folder}" in stale.commands, stale.commands
    # node2 serves no llama-server now: md-failover's script goes too (the destroy test found
    # it left once the server had moved away).
    assert "md-failover-*.py" in stale.commands[-1], stale.commands
    kept = services.stale_units(context(cluster, "node1", units, manager))  # node1 serves main
    assert not any("md-failover-*.py" in c for c in kept.commands), kept.commands
    (step,) = services.destroy(context(cluster, "node2", units, manager), purge=False).steps
    assert step.commands[-1] == f"rm -rf -- {folder}", step.commands
    rooted = services.destroy(context(rootless_lab(manager, hosts=()), "node2", units,
                                      manager), purge=False).steps[0]
    assert not any(c.startswith("rm -rf") for c in rooted.commands), rooted.commands
    with pytest.raises(PlanError):  # a name a host reported, checked before it reaches a path
        services.stale_units(context(cluster, "node2", {"meshdeploy-server-x/../..": units[unit]},
                                     manager))


def test_md_failovers_scripts_go_and_their_folder_once_empty(tmp_path):
    """Run for real: the rootless lab's destroy found an empty tools folder left behind once
    the server had moved off the host."""
    from types import SimpleNamespace

    tools = tmp_path / "tools"
    for others in ((), ("md-rpc-seed",)):
        tools.mkdir()
        (tools / "md-failover-0123456789ab.py").write_text("x")
        for name in others:
            (tools / name).write_text("y")
        command = services._failover_scripts_removed(SimpleNamespace(prefix=str(tmp_path)))
        assert subprocess.run(["sh", "-c", command]).returncode == 0
        assert (sorted(p.name for p in tools.iterdir()) if tools.exists() else None) == \
            (list(others) or None)
        shutil.rmtree(tools, ignore_errors=True)


def test_user_health_wait_reads_nrestarts_through_systemctl_user(tmp_path):
    step = orchestrator.llama_server(context(rootless_lab(SYSTEMD_USER), "node1",
                                             manager=SYSTEMD_USER), "main")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text('#!/bin/sh\necho "$*" >> "$SEEN"; echo 0\n')
    (bin_dir / "systemctl").chmod(0o755)
    (bin_dir / "curl").write_text("#!/bin/sh\necho 200\n")
    (bin_dir / "curl").chmod(0o755)
    done = subprocess.run(["sh", "-c", step.commands[-1]], capture_output=True, text=True,
                          timeout=30, env={"PATH": f"{bin_dir}:/usr/bin:/bin",
                                           "SEEN": str(tmp_path / "seen")})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().startswith(
        "--user show -p NRestarts --value meshdeploy-server-main")


# -- API key files ------------------------------------------------------------------------------

@pytest.mark.parametrize("manager", MANAGERS)
def test_api_key_file_must_be_the_login_users_alone(manager):
    cluster = rootless_lab(manager)
    server = dataclasses.replace(cluster.servers[0], api_key_file="/home/md/key")
    cluster = dataclasses.replace(cluster, servers=(server,))
    key = "services.KeyFile[main]"
    ok = {"exists": True, "mode": 0o600, "uid": 1000, "owner": "md", "reader": 1000}
    assert services.preflight(context(cluster, "node1", manager=manager, **{key: ok})) is None
    with pytest.raises(PlanError) as loose:
        services.preflight(context(cluster, "node1", manager=manager,
                                   **{key: {**ok, "mode": 0o644}}))
    assert loose.value.hint.startswith("chmod 600 /home/md/key")
    with pytest.raises(PlanError, match="owned by root"):
        services.preflight(context(cluster, "node1", manager=manager,
                                   **{key: {**ok, "uid": 0, "owner": "root"}}))
    step = orchestrator.llama_server(context(cluster, "node1", manager=manager), "main")
    assert "\nLoadCredential" not in step.change.unit_diff and "CREDENTIALS" not in step.change.unit_diff
    assert "--api-key-file /home/md/key" in step.change.unit_diff.replace("'", "")
    [section] = [s for s in services.sections(cluster, cluster.host("node1")) if s.key == key]
    assert not section.privileged and section.kwargs["reader"]


def test_key_file_fact_reads_the_reader_here(tmp_path):
    path = tmp_path / "key"
    path.write_text("k\n")
    path.chmod(0o600)
    out = subprocess.run(["sh", "-c", KeyFile().command(str(path), reader=True)],
                         capture_output=True, text=True).stdout.splitlines()
    got = KeyFile().process(out)
    assert got["mode"] == 0o600 and got["uid"] == got["reader"] == os.geteuid()


# -- real runit ------------------------------------------------------------------------------

def user_prefix() -> list[str]:
    """Run as an unprivileged user (nobody) when the tests run as root."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture
def runsvdir():
    require("runsvdir", "sv", "svlogd")
    if os.geteuid() == 0:
        require("setpriv")  # to run runit unprivileged
    # Not under pytest's tmp_path: its parents are root's alone (0700), closed to `nobody`.
    top = Path(tempfile.mkdtemp(prefix="md-runit-"))
    top.chmod(0o755)
    base = top / "home"
    (base / "sv").mkdir(parents=True)
    (base / "cache").mkdir()
    (base / "bin").mkdir()
    subprocess.run(["chown", "-R", "65534:65534", str(base)] if os.geteuid() == 0 else ["true"],
                   check=True)
    proc = subprocess.Popen([*user_prefix(), "runsvdir", "-P", str(base / "sv")],
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        yield base
    finally:
        # HUP: runsvdir sends each runsv TERM (it stops its service and log service, then
        # exits) and exits itself; TERM would leave the runsv processes running.
        proc.send_signal(1)
        proc.wait(timeout=10)
        time.sleep(1)
        shutil.rmtree(top, ignore_errors=True)


def sh(command: str) -> subprocess.CompletedProcess:
    return subprocess.run([*user_prefix(), "sh", "-c", command], capture_output=True, text=True,
                          timeout=60)


def units_fact(layout) -> dict:
    out = sh(Units().command(layout.services, RUNIT))
    return Units().process(out.stdout.splitlines())


def eventually(read, ok, seconds: float = 5):
    end = time.monotonic() + seconds
    while True:
        value = read()
        if ok(value) or time.monotonic() > end:
            return value
        time.sleep(0.2)


@pytest.mark.system
def test_real_runit_supervises_restarts_and_removes(runsvdir):
    from meshdeploy.config.model import Layout

    layout = Layout(prefix=str(runsvdir), cache=str(runsvdir / "cache"), run=str(runsvdir),
                    services=str(runsvdir / "sv"), manager=RUNIT, home=str(runsvdir))
    tools = RunitTools().process(sh(RunitTools().command()).stdout.splitlines())
    assert tools["sh"] and tools["svlogd"]
    mgr = Runit(layout, tools, "t")
    unit = "meshdeploy-rpc-50052"
    stub = runsvdir / "bin" / "worker"
    stub.write_text('#!/bin/sh\necho "worker up: $1"\nexec sleep 1000\n')
    stub.chmod(0o755)
    run = services.rootless.runit_run(
        dataclasses.replace(load_cluster(ROOT / "inventories" / "lab.yaml"), name="t"),
        [str(stub), HOSTILE], {}, "a worker", tools["sh"], "test")
    for command in [*mgr.write(unit, run), mgr.install(unit)]:
        done = sh(command)
        assert done.returncode == 0, done.stderr
    # runsv starts a service that ran under a second again only a second later: the restart
    # right after runsvdir's own first start may leave it "down, want up" for that second.
    state = eventually(lambda: units_fact(layout)[unit], lambda u: u["active"] == "active")
    assert (state["active"], state["enabled"]) == ("active", "enabled")
    assert state["content"] == run and state["log"] == mgr.log_run(unit)
    assert not mgr.differs(state, run, unit)
    current = Path(mgr.log_dir(unit)) / "current"
    for _ in range(50):
        if current.exists() and f"worker up: {HOSTILE}" in current.read_text():
            break
        time.sleep(0.2)
    assert f"worker up: {HOSTILE}" in current.read_text()  # svlogd -tt, argv intact
    def pid():
        status = sh(f"sv status {mgr.path(unit)}").stdout
        return status.split("(pid ")[1].split(")")[0] if status.startswith("run:") else None

    before = eventually(pid, bool)
    assert before and sh(mgr.restart(unit)).returncode == 0
    assert eventually(pid, lambda p: p and p != before) not in (None, before)
    assert sh(mgr.stop(unit)).returncode == 0  # sv -w: returns once it is down
    assert units_fact(layout)[unit]["active"] == "inactive"
    done = sh(mgr.remove(unit))
    assert done.returncode == 0, done.stderr
    assert units_fact(layout) == {}
    assert not Path(mgr.path(unit)).exists() and not Path(mgr.log_dir(unit)).exists()
    assert list((runsvdir / "sv").iterdir()) == []
    left = subprocess.run(["pgrep", "-f", str(stub)], capture_output=True, text=True).stdout
    assert left == "", f"the worker outlived its removal: {left}"


def test_units_fact_parses_runit_output():
    out = ["@@unit meshdeploy-rpc-50052 active enabled 1700000100 1700000000", "#!/bin/sh",
           "exec x", "@@log", "#!/bin/sh", "exec svlogd -tt /c"]
    got = Units().process(out)
    assert got["meshdeploy-rpc-50052"]["content"] == "#!/bin/sh\nexec x\n"
    assert got["meshdeploy-rpc-50052"]["log"] == "#!/bin/sh\nexec svlogd -tt /c\n"
    assert got["meshdeploy-rpc-50052"]["started"] == 1700000100


# systemctl show as systemd 248 and later answer --timestamp=unix ("@N"), and as older ones,
# which refuse the option (and say the local time, which the host's date turns into seconds).
_NEW_SYSTEMCTL = 'case "$*" in *--timestamp=unix*) t=@1700000000 ;; *) exit 9 ;; esac\n'
_OLD_SYSTEMCTL = ('case "$*" in *--timestamp=*) echo "Unknown timestamp format" >&2; exit 1 ;; '
                  'esac; t="Thu 2023-11-14 22:13:20 UTC"\n')


@pytest.mark.parametrize("systemctl,calls_made", [(_NEW_SYSTEMCTL, 1), (_OLD_SYSTEMCTL, 2)],
                         ids=["systemd-248-and-later", "older-systemd"])
def test_systemd_units_are_read_with_one_systemctl_call(tmp_path, systemctl, calls_made):
    """systemd --user (and the system's, the same script): every unit's state from one
    `systemctl show` (a second, without --timestamp=unix, where systemd is older than 248),
    its start time in epoch seconds, each file's text."""
    units = tmp_path / "units"
    units.mkdir()
    (units / "meshdeploy-rpc-50052.service").write_text("[Service]\nExecStart=/x rpc\n")
    (units / "meshdeploy-server-main.service").write_text("[Service]\nExecStart=/x server\n")
    (units / "other.service").write_text("[Service]\n")  # not meshdeploy's
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n' + systemctl +
        "printf '%s\\n' Id=meshdeploy-rpc-50052.service ActiveState=active "
        "UnitFileState=enabled \"ExecMainStartTimestamp=$t\" '' "
        "Id=meshdeploy-server-main.service ActiveState=inactive UnitFileState=disabled "
        "ExecMainStartTimestamp=\n")
    (bin_dir / "systemctl").chmod(0o755)
    out = subprocess.run(["sh", "-c", Units().command(str(units), SYSTEMD_USER)],
                         capture_output=True, text=True, timeout=20,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    got = Units().process(out.stdout.splitlines())
    show = "--user show -p Id -p ActiveState -p UnitFileState -p ExecMainStartTimestamp "
    names = "meshdeploy-rpc-50052.service meshdeploy-server-main.service"
    assert calls.read_text().splitlines() == [f"{show}--timestamp=unix {names}",
                                              f"{show}{names}"][:calls_made]
    rpc, server = got["meshdeploy-rpc-50052"], got["meshdeploy-server-main"]
    assert (rpc["active"], rpc["enabled"], rpc["started"]) == ("active", "enabled", 1700000000)
    assert (server["active"], server["enabled"], server["started"]) == (
        "inactive", "disabled", None)
    assert rpc["content"] == "[Service]\nExecStart=/x rpc\n"
    assert rpc["written"] == int((units / "meshdeploy-rpc-50052.service").stat().st_mtime)
    assert set(got) == {"meshdeploy-rpc-50052", "meshdeploy-server-main"}


# -- status, logs, exec and bench on rootless hosts ---------------------------------------------

def stub_bin(tmp_path, **tools) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize("manager", MANAGERS)
def test_status_asks_the_hosts_own_manager(manager, tmp_path):
    from meshdeploy.commands.status import host_script

    cluster = rootless_lab(manager)
    env = stub_bin(tmp_path, sv='echo "run: $2: (pid 7) 5s; run: log: (pid 8) 5s"\n',
                   systemctl='[ "$1" = --user ] && [ "$2" = is-active ] && echo active\n',
                   python3="echo down\n", curl="echo 200\n")
    out = subprocess.run(["sh", "-c", host_script(cluster, cluster.host("node2"))],
                         capture_output=True, text=True, env=env, timeout=30).stdout
    assert "rpc 50052 active down" in out.splitlines()
    script = host_script(cluster, cluster.host("node2"))
    assert "systemctl is-active" not in script
    layout = cluster.host("node2").layout
    if manager == RUNIT:
        assert f"SVDIR_MD={layout.services}" in script
    else:
        assert "systemctl --user is-active" in script


def test_status_of_a_host_with_root_is_unchanged():
    from meshdeploy.commands.status import host_script

    plain = load_cluster(ROOT / "inventories" / "lab.yaml")
    script = host_script(plain, plain.host("node2"))
    assert 'systemctl is-active "$3"' in script and "md_active" not in script


def test_logs_of_runit_tail_svlogd_files_and_read_their_times(tmp_path):
    from meshdeploy.views.log_lines import HostStream, host_script, parse
    from meshdeploy.core import registry

    cluster = rootless_lab(RUNIT)
    sources = [s for s in registry.log_sources(cluster) if s.host == "node2"]
    layout = cluster.host("node2").layout
    assert sources[0].launchd_log == f"{layout.cache}/log/meshdeploy-rpc-50052/current"
    env = stub_bin(tmp_path, tail='for a; do echo "2026-11-26_16:40:54.12345 tail arg: $a"; '
                                  'done\n')
    out = subprocess.run(["sh", "-c", host_script(sources, 5, None, False, RUNIT)],
                         capture_output=True, text=True, env=env, timeout=30).stdout
    assert out.splitlines()[:2] == ["@runit", "@unit meshdeploy-rpc-50052"]
    lines = parse(HostStream("node2", 1, sources), out, now=1)
    assert [line.text for line in lines][-1] == f"tail arg: {sources[0].launchd_log}"
    from datetime import datetime, timezone

    utc = datetime(2026, 11, 26, 16, 40, 54, tzinfo=timezone.utc).timestamp()
    assert lines[0].time == int(utc) * 1_000_000 + 123_450  # svlogd's UTC time, not `now`


def test_logs_of_systemd_user_read_the_users_journal(tmp_path):
    from meshdeploy.views.log_lines import host_script
    from meshdeploy.core import registry

    cluster = rootless_lab(SYSTEMD_USER)
    sources = [s for s in registry.log_sources(cluster) if s.host == "node2"]
    env = stub_bin(tmp_path, journalctl='echo "journalctl $*"\n', uname="echo Linux\n")
    out = subprocess.run(["sh", "-c", host_script(sources, 5, None, False, SYSTEMD_USER)],
                         capture_output=True, text=True, env=env, timeout=30).stdout
    assert "journalctl --user --no-pager -o json -u meshdeploy-rpc-50052 -n 5" in out


class _Here:
    """A connection that runs here: what remote.each hands read_layouts."""

    def __init__(self, home):
        self.home = home

    def run(self, command, **kwargs):
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", "HOME": self.home,
                                   "XDG_RUNTIME_DIR": "/run/user/1000"})
        return subprocess.CompletedProcess(command, done.returncode, done.stdout, done.stderr)


def test_fabric_commands_read_a_rootless_hosts_layout_like_the_session(tmp_path):
    from meshdeploy.commands.common import read_layouts
    from meshdeploy.remote.connections import Hosts

    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    cluster = dataclasses.replace(cluster, hosts=tuple(
        dataclasses.replace(h, rootless=True, layout=None) if h.name == "node2" else h
        for h in cluster.hosts))
    # This machine runs neither systemd --user nor a runsvdir of its user: refused with the fix.
    got, failed = read_layouts(cluster, Hosts({"node2": _Here(str(tmp_path)),
                                               "node1": _Here(str(tmp_path))}, {}))
    assert got.host("node2").layout is None
    assert "loginctl enable-linger" in failed["node2"] and "node1" not in failed


def test_exec_sudo_is_refused_on_a_rootless_host(tmp_path, monkeypatch):
    from meshdeploy import errors
    from meshdeploy.commands import exec_

    text = (ROOT / "inventories" / "lab.yaml").read_text().replace(
        "  node2:\n", "  node2:\n    rootless: true\n", 1)
    path = tmp_path / "lab.yaml"
    path.write_text(text.replace("firewall: true", "firewall: false"))
    args = exec_.Args(file=str(path), argv=["id"], limit=None, sudo=True,
                      accept_new_host_keys=False)
    with pytest.raises(errors.MeshdeployError, match="node2 is rootless"):
        exec_.run(args)


@pytest.mark.system
def test_the_account_script_finds_the_users_runsvdir_over_its_folder(runsvdir):
    """core.account's script, run as the user beside a real runsvdir of that user: runit is its
    service manager over SVDIR; the same runsvdir does not count for another SVDIR."""
    def read(svdir: str):
        env = ["env", "-i", f"HOME={runsvdir}", f"SVDIR={svdir}", "PATH=/usr/bin:/bin"]
        out = subprocess.run([*user_prefix(), *env, "sh", "-c", account.SCRIPT],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return account.parse("phone", out.stdout.splitlines())

    layout = account.layout(read(f"{runsvdir}/sv"))
    assert (layout.manager, layout.services) == (RUNIT, f"{runsvdir}/sv")
    with pytest.raises(PlanError, match="no runsvdir of the user runs over"):
        account.layout(read(f"{runsvdir}/other"))


def test_logs_since_on_runit_keeps_svlogd_lines_from_then_on(tmp_path):
    """--since reaches runit hosts too: all of svlogd's lines are read (not the last 10), and
    only those from the cutoff on are kept, by the time each line carries."""
    from datetime import datetime, timezone

    from meshdeploy.views.log_lines import HostStream, host_script, parse, since_cutoff
    from meshdeploy.core import registry

    cluster = rootless_lab(RUNIT)
    source = [s for s in registry.log_sources(cluster) if s.host == "node2"][0]
    log = tmp_path / "current"
    old = [f"2026-11-26_10:{m:02d}:00.000000 old line {m}" for m in range(30)]
    new = [f"2026-11-26_16:{m:02d}:00.000000 new line {m}" for m in range(3)]
    log.write_text("\n".join(old + new) + "\n")
    sources = [dataclasses.replace(source, launchd_log=str(log))]
    now = datetime(2026, 11, 26, 17, 0, tzinfo=timezone.utc)
    cutoff = since_cutoff("2h", now)
    assert cutoff == int(datetime(2026, 11, 26, 15, 0, tzinfo=timezone.utc).timestamp()) * 10**6
    out = subprocess.run(["sh", "-c", host_script(sources, None, "-2h", False, RUNIT)],
                         capture_output=True, text=True, timeout=30).stdout
    assert len(out.splitlines()) == 2 + len(old) + len(new)  # every line, not the last 10
    kept = parse(HostStream("node2", 1, sources, since=cutoff), out, now=1)
    assert [line.text for line in kept] == [f"new line {m}" for m in range(3)]
    # Without --since: the last lines, as before.
    out = subprocess.run(["sh", "-c", host_script(sources, 10, None, False, RUNIT)],
                         capture_output=True, text=True, timeout=30).stdout
    assert len(parse(HostStream("node2", 1, sources), out, now=1)) == 10
