"""One regression test per root cause of issue 10, each with its minimal reproducer: a value from
the cluster file, a lock file or a Hub answer must never run a command it does not name."""

from __future__ import annotations

import dataclasses
import os
import plistlib
import re
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshdeploy.commands.status import collect, host_script
from meshdeploy.core.loading import load_cluster
from meshdeploy.core import probe
from meshdeploy.core.context import HostContext
from meshdeploy.engine.planner import gather, probe_command
from meshdeploy.errors import PlanError
from meshdeploy.roles.llama_cpp import lock as locks
from meshdeploy.roles.llama_cpp.facts import RemoteRef, ls_remote
from meshdeploy.roles.models import hf
from meshdeploy.roles.models.facts import ModelFile
from meshdeploy.roles.rpc_cache.seeding import cache_file
from meshdeploy.roles.services import operations as services
from meshdeploy.roles.services import orchestrator
from meshdeploy.roles.services import unit_files
from meshdeploy.roles.toolchain import operations as toolchain
from meshdeploy.roles.llama_cpp import settings
from support import systemd_parse as sd
from support.resolved import run_values

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "inventories" / "lab.yaml"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"


@pytest.fixture
def lab():
    return load_cluster(LAB)


def stubs(tmp_path: Path, names, body='printf "%s\\n" "$0 $*" >> "$STUB_LOG"') -> dict:
    """A PATH of stub programs that only log their argv; real git/curl/systemctl never run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        stub = bin_dir / name
        stub.write_text(f"#!/bin/sh\n{body}\n")
        stub.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_LOG": str(tmp_path / "log"),
            "HOME": str(tmp_path)}


def run(script: str, tmp_path: Path, env: dict, shell_name="bash") -> subprocess.CompletedProcess:
    return subprocess.run([shell_name, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=30)


def with_server(cluster, **changes):
    server = dataclasses.replace(cluster.servers[0], **changes)
    return dataclasses.replace(cluster, servers=(server,)), server


# -- servers.*.bind ---------------------------------------------------------------------------------

BIND = "127.0.0.1;touch PWNED"


def test_bind_in_the_health_wait_is_one_word(lab, tmp_path):
    _, server = with_server(lab, bind=BIND)
    env = stubs(tmp_path, ["curl", "journalctl"], body='echo 200')
    out = run(orchestrator.health_wait(server), tmp_path, env)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "PWNED").exists()


def test_bind_in_status_is_one_word(lab, tmp_path):
    cluster, server = with_server(lab, bind=BIND)
    env = stubs(tmp_path, ["curl", "systemctl", "python3", "sed"])
    out = run(host_script(cluster, cluster.host(server.host)), tmp_path, env, "sh")
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "PWNED").exists()
    log = (tmp_path / "log").read_text()
    assert f"--max-time 5 http://{BIND}:8080/health" in log


def test_status_runs_unprivileged(lab):
    calls = []

    class Session:
        cluster = lab

        def hosts(self):
            return lab.hosts

        def run(self, name, command, sudo=None):
            calls.append(sudo)
            return True, SimpleNamespace(stdout_lines=[])

    collect(Session())
    assert calls and all(s is False for s in calls)


# -- llama_cpp.repo / ref: never an option, never the ext:: transport --------------------------------

@pytest.mark.parametrize("repo,ref", [("--upload-pack=touch PWNED", "b1"),
                                      ("git://10.0.0.1/l.git", "--upload-pack=touch PWNED")])
def test_remote_ref_and_apply_resolve_pass_repo_and_ref_after_dashdash(repo, ref, tmp_path):
    expected = ["-c", "protocol.ext.allow=never", "ls-remote", "--", repo, ref, f"{ref}^{{}}"]
    assert shlex.split(ls_remote(repo, ref)) == ["env", "GIT_TERMINAL_PROMPT=0", "git", *expected]
    env = stubs(tmp_path, ["git", "timeout"], body='[ "$(basename "$0")" = timeout ] && '
                'shift && exec "$@"; for a in "$@"; do printf "%s\\n" "$a"; done >> "$STUB_LOG"')
    out = run(RemoteRef().command(repo=repo, ref=ref), tmp_path, env, "sh")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "log").read_text().splitlines() == expected
    # Real git, never over the network: the option-looking repository is refused outright, and
    # an option-looking ref is only a pattern for a local repository.
    if not repo.startswith("--"):
        subprocess.run(["git", "init", "-q", "--bare", str(tmp_path / "r.git")], check=True)
        repo = str(tmp_path / "r.git")
    real = subprocess.run(["sh", "-c", ls_remote(repo, ref)], cwd=tmp_path, capture_output=True,
                          timeout=30, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert not (tmp_path / "PWNED").exists(), real.stderr


def test_lock_file_commit_must_be_40_hex(lab, tmp_path):
    cluster_file = tmp_path / "c.yaml"
    cluster_file.write_text(LAB.read_text())
    cluster = dataclasses.replace(lab, path=cluster_file)
    bad = {"llama_cpp": {"repo": settings.of(cluster).repo, "ref": settings.of(cluster).ref,
                         "commit": "HEAD; reboot"}}
    with pytest.raises(PlanError, match="not a 40-hex commit"):
        locks.locked_commit(cluster, bad)
    with pytest.raises(PlanError):
        locks.write_lock(cluster_file, "r", "b1", "HEAD; reboot")
    assert locks.locked_commit(cluster, {"llama_cpp": "junk"}) is None
    good = {"llama_cpp": {**bad["llama_cpp"], "commit": COMMIT}}
    assert locks.locked_commit(cluster, good) == COMMIT
    assert not locks.FULL_COMMIT.fullmatch(COMMIT + "\n")


# -- the probe ----------------------------------------------------------------------------------

def test_model_file_names_reach_the_probe_quoted(tmp_path):
    weird = tmp_path / "a'b"
    weird.write_bytes(b"GGUF1234")
    sections = [probe.Section("models.ModelFile[m/a'b]", ModelFile, {"path": str(weird)}),
                probe.Section("models.ModelFile[m/x]", ModelFile, {"path": str(tmp_path / "x")})]
    out = run(probe.compose(sections, "n0nce"), tmp_path, {"PATH": "/usr/bin:/bin"}, "sh")
    facts = probe.decode(sections, probe.split(out.stdout.splitlines(), sections, "n0nce"))
    assert facts["models.ModelFile[m/a'b]"]["size"] == 8
    assert facts["models.ModelFile[m/x]"]["size"] is None


def test_a_fact_cannot_forge_a_section(tmp_path):
    """A file name with a newline and the marker text, and output that prints a marker."""
    forged = f"x\n{probe.MARKER}guess 1\nfile 999 1"
    sections = [probe.Section(f"models.ModelFile[m/{forged}]", ModelFile,
                              {"path": str(tmp_path / forged)}),
                probe.Section("models.ModelFile[m/real]", ModelFile,
                              {"path": str(tmp_path / "real")})]

    class Liar(ModelFile):
        def command(self, path):
            return f"printf '%s\\n' '{probe.MARKER}guess 1' 'file 999 1'"

    sections[0].fact = Liar
    nonce = probe.new_nonce()
    out = run(probe.compose(sections, nonce), tmp_path, {"PATH": "/usr/bin:/bin"}, "sh")
    raw = probe.split(out.stdout.splitlines(), sections, nonce)
    assert raw[sections[1].key] == ["file ", "marker ", "part ", "link "]
    facts = probe.decode(sections, raw)
    assert facts["models.ModelFile[m/real]"]["size"] is None
    # The marker never carries the key: a key cannot split its own marker line.
    assert forged not in probe.compose(sections, nonce).split("\n(")[0]


def test_probe_runs_unprivileged_except_privileged_sections(lab):
    host = dataclasses.replace(lab.host("node2"), rpc_servers=(
        dataclasses.replace(lab.host("node2").rpc_servers[0], cache=True),))
    cluster = dataclasses.replace(lab, hosts=(lab.hosts[0], host, lab.hosts[2]))
    sections, script = probe_command(cluster, host, False, "n")
    privileged = [s.key for s in sections if s.privileged]
    # network.SshKey on every host with a layout: what an earlier network.transport: ssh apply
    # left is found under any transport (its folder is root's); network.SshdStreamLocal on
    # every root host (sshd -T, and a drop-in an earlier apply left).
    assert sorted(privileged) == ["network.Allowlist", "network.SshKey",
                                  "network.SshdStreamLocal", "network.WireGuard",
                                  "rpc_cache.CacheDir[50052]"]
    # One sudo for the whole probe: the privileged sections come right after probe.SudoCheck,
    # whose answer is that root shell's first line.
    assert script.count("sudo -n") == 1
    assert sections[0].key == "probe.SudoCheck"
    # The root shell's script (the word after `sudo -n sh -c`) holds the markers of the
    # privileged sections, and only theirs.
    as_root, outside, rest = [], script, script
    while "sudo -n sh -c " in rest:
        rest = rest.split("sudo -n sh -c ", 1)[1]
        lexer = shlex.shlex(rest, posix=True)
        lexer.whitespace_split = True
        inner = lexer.get_token()
        as_root.append(inner)
        outside = outside.replace(shlex.quote(inner), "")
    marked = {s.key: f"@@meshdeploy-section n {i}" for i, s in enumerate(sections)}
    for key, mark in marked.items():
        inside = any(re.search(re.escape(mark) + r"(?![0-9])", r) for r in as_root)
        assert inside == (key in privileged), key
        assert bool(re.search(re.escape(mark) + r"(?![0-9])", outside)) != inside, key
    assert len(as_root) == 1 and as_root[0].startswith("echo ok\n")
    # Without ssh.sudo nothing is wrapped (and no sudo check is made).
    plain = dataclasses.replace(host, ssh=dataclasses.replace(host.ssh, sudo=False))
    _, script = probe_command(cluster, plain, False, "n")
    assert "sudo" not in script


def test_gather_runs_one_unprivileged_command_and_reports_refused_sudo(lab, tmp_path):
    calls = []

    class Session:
        cluster = lab

        def hosts(self):
            return [lab.host("node2")]

        def run(self, name, command, sudo=None):
            calls.append(sudo)
            # No network: git (RemoteRef on the first host) is a stub like sudo.
            env = stubs(tmp_path, ["sudo", "git", "timeout"],
                        body='echo "sudo: a password is required"; exit 1')
            out = run(command, tmp_path, {**env, "PATH": env["PATH"]}, "sh")
            return True, SimpleNamespace(stdout_lines=out.stdout.splitlines(), stderr_lines=[])

    from meshdeploy.errors import ConnectError
    with pytest.raises(ConnectError, match="node2: sudo refused for user deploy: sudo: a password"):
        gather(Session())
    assert calls == [False]


# -- Hub answers ----------------------------------------------------------------------------------

def fake_hub(monkeypatch, sha256="a" * 64, size=10, commit="b" * 40):
    import huggingface_hub

    sibling = SimpleNamespace(rfilename="gemma-3-270m-q4_k_m.gguf", size=size,
                              lfs=SimpleNamespace(sha256=sha256, size=size))

    class Api:
        def __init__(self, **kwargs):
            pass

        def model_info(self, *args, **kwargs):
            return SimpleNamespace(sha=commit, siblings=[sibling])

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)


@pytest.mark.parametrize("field,value", [("sha256", "$(reboot)"), ("sha256", "../../x"),
                                         ("sha256", "A" * 64), ("size", -1), ("size", "10"),
                                         ("commit", "HEAD; reboot")])
def test_hub_answers_are_checked(lab, monkeypatch, field, value):
    fake_hub(monkeypatch, **{field: value})
    model = dataclasses.replace(lab.models["gemma"], source=dataclasses.replace(
        lab.models["gemma"].source, sha256=None))
    with pytest.raises(PlanError, match=r"models\.gemma\.huggingface: http://127\.0\.0\.1:18080 "
                                        r"answered"):
        hf.resolve(lab, model)


def test_hub_answer_that_is_fine_resolves(lab, monkeypatch):
    fake_hub(monkeypatch)
    model = dataclasses.replace(lab.models["gemma"], source=dataclasses.replace(
        lab.models["gemma"].source, sha256=None))
    assert hf.resolve(lab, model).files[0].sha256 == "a" * 64
    for name in ("../x.gguf", "/etc/x", "a//b", "a/./b", ""):
        assert not hf.safe_relative_path(name)


def test_header_cache_never_leaves_its_folder(tmp_path):
    for key in ("../../x", "$(reboot)", "a" * 63, "a" * 64 + "/.."):
        with pytest.raises(PlanError, match="not a sha256"):
            cache_file(tmp_path, key, "models.m")
    assert cache_file(tmp_path, "a" * 64, "models.m") == (tmp_path / f"{'a' * 64}.gguf").resolve()


# -- systemd units and plists ----------------------------------------------------------------------

def server_unit(cluster, server, **kw):
    host = cluster.host(server.host)
    return unit_files.server_unit(cluster, host, server, "/opt/meshdeploy/builds/k",
                                  kw.get("flags"), kw.get("sha"))


@pytest.mark.parametrize("arg", ["x\nExecStartPre=+/bin/sh -c 'touch /PWNED'", "ok\n", "a\rb"])
def test_extra_args_with_a_newline_are_refused(lab, arg):
    cluster, server = with_server(lab, extra_args=("--verbose", arg))
    with pytest.raises(PlanError, match=r"servers\.main \(ExecStart\)"):
        server_unit(cluster, server)


def test_specifiers_and_variables_in_extra_args_stay_literal(lab):
    cluster, server = with_server(lab, extra_args=("%h", "$HOME", "${HOME}", "a b\"c\\"),
                                  api_key_file="/etc/key 100%")
    unit = server_unit(cluster, server)
    assert ' %%h $$HOME "$${HOME}" ' in unit
    (exec_start,) = [v for k, v in sd.settings(unit) if k == "ExecStart"]
    argv = sd.exec_argv(exec_start)
    assert argv[-4:] == ["%h", "$HOME", "${HOME}", "a b\"c\\"]
    assert not any(isinstance(a, sd.Expansion) for a in argv[-4:])
    # The credential path stays the one intended systemd expression.
    key = argv[argv.index("--api-key-file") + 1]
    assert isinstance(key, sd.Expansion) and key == "${CREDENTIALS_DIRECTORY}/api-key"
    assert ("LoadCredential", "api-key:/etc/key 100%%") in sd.settings(unit)


def test_unit_names_and_descriptions_are_checked(lab):
    cluster, server = with_server(lab, name="../../cron.d/x")
    with pytest.raises(PlanError, match="valid service name"):
        server_unit(cluster, server)
    cluster, server = with_server(lab, bind="127.0.0.1\nExecStartPre=+/bin/sh")
    with pytest.raises(PlanError, match=r"servers\.main"):
        server_unit(cluster, server)


def test_plist_round_trips_xml_specials():
    argv = ["/opt/x/bin/llama-server", "--alias", "<a & b>]]>", "'\"$(x)%h"]
    text = services.launchd_plist("com.meshdeploy.server-main", argv, {"K": "<&]]>"}, "/var/log")
    doc = plistlib.loads(text.encode())
    assert doc["ProgramArguments"] == argv and doc["EnvironmentVariables"] == {"K": "<&]]>"}
    with pytest.raises(PlanError):
        services.launchd_plist("com.meshdeploy.x", ["/x", "a\x01"], {}, "/var/log")


# -- toolchain.apt_proxy ----------------------------------------------------------------------------

@pytest.mark.parametrize("proxy", ['http://x:3142";\nAPT::Update::Pre-Invoke {"touch /PWNED";};//',
                                   'http://x/"', "http://x/;", "http://x/{", "http://x /",
                                   "http://x/\n"])
def test_apt_proxy_that_could_write_apt_options_is_refused(lab, proxy):
    cluster = dataclasses.replace(lab, sections={**lab.sections,
                                                 "toolchain": {"apt_proxy": proxy}})
    ctx = HostContext(cluster, cluster.hosts[0],
                      {"toolchain.Platform": {"kernel": "Linux", "tools": ["apt-get"]},
                       "toolchain.AptProxy": None}, run_values())
    with pytest.raises(PlanError, match="toolchain.apt_proxy"):
        toolchain.apt_proxy(ctx)


def test_no_test_left_a_sentinel():
    assert not os.path.exists("/PWNED")
