"""The models and rpc_cache roles on rootless hosts (issue 22).

Plans of the lab's cluster with rootless hosts: a Termux-like worker (runit), a rootless Linux
worker (systemd --user), both with `cache: true`, fetching their tensors or (fetch: false)
copying the GGUF; and the model's source rootless too, sharing it. Every path their commands and
probes name is under the login user's folders, and nothing runs through sudo or the system's
service manager (tests/golden/plan/rootless-*.txt hold the plans). Then the rootless seed for
real, as a user without root (nobody, through setpriv) with the real md-rpc-seed: into its own
cache folder, refusing links planted at the folder and at every name it writes, its probe
reading the marker as that user, and a seed stopped mid-way by the step's guard.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from support.device_facts import cpu
from support.resolved import run_values
from test_rpc_cache import SHA, synthetic  # noqa: F401 (fixture)
from test_seed_links import _wanted

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.model import SYSTEMD_USER
from meshdeploy.config.sources import HfFile, HfResolved
from meshdeploy.core import account, inflight, registry, share
from meshdeploy.core.context import HostContext, Steps
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.probe import Section
from meshdeploy.engine import planner as engine
from meshdeploy.placement import tensors as T
from meshdeploy.roles.models import operations as models
from meshdeploy.roles.rpc_cache import defaults as d
from meshdeploy.roles.rpc_cache import operations as ops
from meshdeploy.roles.rpc_cache import seeding
from meshdeploy.roles.rpc_cache.facts import CacheDir
from meshdeploy.views.plan import render_transfers

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "plan"
UPDATE = os.environ.get("MESHDEPLOY_UPDATE_GOLDEN") == "1"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
# gemma-3-27b (tests/support/model_headers.py): big enough that every worker caches tensors.
GEMMA = ("gemma-3-27b-it-Q4_K_M.gguf", 16_546_688_416, "ab" * 32)
REPO = "unsloth/gemma-3-27b-it-GGUF"
FREE = 200 * 10**9
NOBODY = pwd.getpwnam("nobody")
AS_USER = os.geteuid() == 0 and shutil.which("setpriv") is not None
needs_user = pytest.mark.skipif(not AS_USER, reason="seeds as a user without root: needs root "
                                                    "(to become nobody) and setpriv")

TERMUX = account.layout(account.parse("phone", [
    "home=/data/data/com.termux/files/home", "user=u0_a123", "uid=10123", "sv=yes",
    "runsvdir=runsvdir -P /data/data/com.termux/files/usr/var/service", "termux_prefix=/data/data/com.termux/files/usr"]))
LINUX = account.layout(account.parse("gpubox", [
    "home=/home/md", "user=md", "uid=1001", "systemd_user=running", "linger=yes",
    "runtime=/run/user/1001"]))


def cluster_text(fetch: bool, source_rootless: bool) -> str:
    cache = "{port: 50052, cache: true}" if fetch else "{port: 50052, cache: true, fetch: false}"
    source = "    rootless: true\n" if source_rootless else "    ssh: {sudo: true}\n"
    return ("cluster: lab\nllama_cpp: {ref: b11312, prefix: /opt/meshdeploy}\n"
            "huggingface: {endpoint: 'http://10.200.0.1:8080'}\n"
            "network: {rpc_bind: address, firewall: false}\n"
            "hosts:\n  node1:\n    address: 10.200.0.11\n" + source +
            "  phone:\n    address: 10.200.0.12\n    rootless: true\n"
            f"    rpc_servers:\n      - {cache}\n"
            "  gpubox:\n    address: 10.200.0.13\n    rootless: true\n"
            f"    rpc_servers:\n      - {cache}\n"
            f"models:\n  gemma:\n    huggingface:\n      repo: {REPO}\n"
            f"      file: {GEMMA[0]}\n      sha256: {GEMMA[2]}\n"
            "servers:\n  main: {host: node1, model: gemma, port: 8080, bind: 127.0.0.1}\n")


# name: (fetch, source rootless, the source's layout, the source's digest list made already)
SCENARIOS = {
    "fetch": (True, False, None, True),
    "copy": (False, False, None, False),
    "fetch-from-rootless-source": (True, True, LINUX, False),
    "copy-from-termux-source": (False, True, TERMUX, False),
}


def planned(name: str, tmp_path: Path):
    """(cluster, steps) of the models and rpc_cache resources, as the engine evaluates them."""
    fetch, source_rootless, source_layout, digested = SCENARIOS[name]
    path = tmp_path / "lab.yaml"
    path.write_text(cluster_text(fetch, source_rootless))
    layouts = {"phone": TERMUX, "gpubox": LINUX}
    if source_rootless:
        layouts["node1"] = source_layout
    cluster = account.resolved(load_cluster(path), layouts)
    hf = HfResolved(REPO, "c" * 40,
                    (HfFile(GEMMA[0], GEMMA[1], GEMMA[2], "http://10.200.0.1:8080/g.gguf"),))
    resolved = run_values(commit=COMMIT, models={"gemma": hf})
    facts = {h.name: {**cpu(25_183_293_440, 22_800_000_000), "models.DiskFree": FREE,
                      "rpc_cache.CacheFree": FREE // 2} for h in cluster.hosts}
    prepared = seeding.prepare(cluster, cluster.hosts, facts, resolved)
    resolved = run_values(commit=COMMIT, models=resolved.value("models", "models"),
                        seeds=prepared.seeds, layouts=prepared.layouts, shared=prepared.shared)
    if digested:  # the source's list, as rpc_cache.share made it (the fetches need it)
        facts["node1"]["rpc_cache.Digests"] = {"gemma": {GEMMA[2]: [
            [off, size, f"{off:016x}", hashlib.sha256(str(off).encode()).hexdigest()]
            for off, size in prepared.shared["gemma"]]}}
    steps = Steps()
    for slot in registry.slots(cluster):
        if slot.resource.role in ("models", "rpc_cache"):
            for h in cluster.hosts:
                ctx = HostContext(cluster, h, facts[h.name], resolved, steps,
                                  cluster_facts=facts)
                steps.add(h.name, slot.name, slot.resource.plan(ctx, slot.key))
    return cluster, steps


def rootless_hosts(cluster):
    return [h for h in cluster.hosts if h.rootless]


# Absolute paths a command may name outside the user's folders: read, run or tested, never
# written (the shell, the null device, the runtime folder's fallback for systemctl --user).
SYSTEM_READ = {"/dev/null", "/bin/sh", "/run/user/"}
_PATH = re.compile(r"(?<![\w.$}/\"-])/[A-Za-z0-9_.@+-][A-Za-z0-9_.@+/-]*")  # not "$D"/name


def paths_named(text: str) -> set[str]:
    # URLs name hosts' paths on other machines, not this one's.
    return set(_PATH.findall(re.sub(r"https?://\S+", "", text)))


def outside(layout, paths) -> list[str]:
    mine = (layout.prefix, layout.cache, layout.run)
    return sorted(p for p in paths if not p.startswith(mine) and p not in SYSTEM_READ)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_rootless_hosts_commands_stay_in_its_folders(name, headers, tmp_path):
    cluster, steps = planned(name, tmp_path)
    ran = 0
    for host in rootless_hosts(cluster):
        for slot, step in steps.on(host.name).items():
            for command in step.commands:
                ran += 1
                # md-share.py written into the prefix is Python that the host keeps, not shell.
                text = str(command).replace(share.SERVER.read_text(), "")
                assert not re.search(r"\bsudo\b", text), (slot, "sudo")
                assert not re.search(r"\b(setpriv|runuser|chown|nobody)\b", text), slot
                # No unit of the system's manager: a systemd-run is md_systemd_run's, called
                # with --user only, and systemctl is the user's.
                for call in re.findall(r"\bmd_systemd_run\b(?!\(\))[^\n]*", text):
                    assert call.startswith("md_systemd_run --user "), call
                assert "systemd-run" not in text or host.layout.manager == SYSTEMD_USER
                assert "DynamicUser" not in text and "/var/" not in text
                assert not outside(host.layout, paths_named(text)), (slot, text[:300])
    assert ran


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_a_rootless_hosts_probe_and_destroy_stay_in_its_folders(name, tmp_path):
    fetch, source_rootless, _, _ = SCENARIOS[name]
    path = tmp_path / "lab.yaml"
    path.write_text(cluster_text(fetch, source_rootless))
    layouts = {"phone": TERMUX, "gpubox": LINUX, "node1": SCENARIOS[name][2] or LINUX}
    cluster = account.resolved(load_cluster(path), layouts)
    for host in rootless_hosts(cluster):
        sections: list[Section] = [*models.sections(cluster, host),
                                   *models.destroy_sections(cluster, host),
                                   *ops.sections(cluster, host),
                                   *ops.destroy_sections(cluster, host)]
        keys = {s.key for s in sections}
        assert "models.DiskFree" in keys
        for section in sections:
            text = section.fact().command(**section.kwargs)
            assert not section.privileged or section.key == "rpc_cache.DeviceMemory", section.key
            assert "setpriv" not in text and "sudo" not in text, section.key
            # What a probe reads is where it is pointed (the facts' own text reads /proc, ...).
            assert not outside(host.layout, {v for v in _values(section.kwargs)
                                             if v.startswith("/")}), section.key
        by_key = {s.key: s for s in sections}
        assert by_key["models.DiskFree"].kwargs["path"] == f"{host.layout.prefix}/models"
        if host.rpc_servers:
            assert by_key["rpc_cache.CacheFree"].kwargs["path"] == host.layout.cache
            probe = by_key["rpc_cache.CacheDir[50052]"]
            assert probe.kwargs == {"path": f"{host.layout.cache}/meshdeploy-rpc-50052/rpc",
                                    "as_user": True}
        assert by_key["rpc_cache.Stored"].kwargs["folders"] == [host.layout.cache]
        # destroy --purge finds md-share's log too: nothing of meshdeploy's stays in the cache.
        assert f"{host.layout.cache}/md-share.log" in by_key["rpc_cache.Stored"].kwargs["paths"]
        # and the source seed_tool compiles beside the binary (it was left behind once, seen
        # in the lab's destroy).
        source = ops.tool_path(host.layout.prefix) + ".c"
        assert source in by_key["rpc_cache.Stored"].kwargs["paths"]
        steps = ops.seed_tool(HostContext(cluster, host, {}, run_values())).commands
        assert not steps or any(source in c for c in steps)


def _values(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _values(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _values(v)


def render(cluster, steps) -> str:
    lines = []
    for host in cluster.hosts:
        for slot, step in steps.on(host.name).items():
            c = step.change
            lines.append(f"{c.address}  {c.action}  {c.reason}")
            lines += [f"    {a.name}: {a.before!r} -> {a.after!r}" for a in c.diffs
                      if isinstance(a, AttrDiff)]
            for command in step.commands:
                text = str(command).replace(share.SERVER.read_text(), "")  # Python, not shell
                named = sorted(p for p in paths_named(text) if p not in SYSTEM_READ)
                lines.append("    writes/reads: " + " ".join(named))
    rows = engine.transfer_rows([h.name for h in cluster.hosts], steps)
    return "\n".join(lines) + "\n\n" + render_transfers(rows) + "\n"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_rootless_plans_golden(name, headers, tmp_path):
    text = render(*planned(name, tmp_path))
    golden = GOLDEN / f"rootless-{name}.txt"
    if UPDATE:
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with MESHDEPLOY_UPDATE_GOLDEN=1"
    assert text == golden.read_text()


def test_a_rootless_disk_too_small_names_the_users_folder(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text(cluster_text(False, True))
    cluster = account.resolved(load_cluster(path), {"phone": TERMUX, "gpubox": LINUX,
                                                    "node1": TERMUX})
    hf = HfResolved("r", "c" * 40, (HfFile(GEMMA[0], GEMMA[1], GEMMA[2], "http://x/g"),))
    ctx = HostContext(cluster, cluster.host("node1"), {"models.DiskFree": 10}, run_values(
        models={"gemma": hf}), cluster_facts={"node1": {}})
    with pytest.raises(Exception) as info:
        models.gguf(ctx, "gemma")
    assert f"under {TERMUX.prefix}" in str(info.value)
    assert "XDG_DATA_HOME" in info.value.hint


# -- the seed for real, as a user without root -------------------------------------------------

@pytest.fixture
def home(seed_bin, synthetic):  # noqa: F811 (fixture)
    """A user's folders (nobody's): the GGUF it seeds from, md-rpc-seed built here, a cache."""
    d = Path(tempfile.mkdtemp(prefix="md-seed-rootless-", dir="/tmp"))
    d.chmod(0o755)
    prefix = d / ".local" / "share" / "meshdeploy"
    (prefix / "tools").mkdir(parents=True)
    shutil.copy(seed_bin, prefix / "tools" / "md-rpc-seed")
    shutil.copy(synthetic, d / "m.gguf")
    (d / ".cache" / "meshdeploy").mkdir(parents=True)
    for path in [d, *d.rglob("*")]:
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def user_layout(home: Path):
    return account.layout(account.parse("phone", [
        f"home={home}", "user=nobody", f"uid={NOBODY.pw_uid}", "sv=yes",
        f"runsvdir=runsvdir -P {home}/sv", f"svdir={home}/sv"]))


def user_ctx(home: Path, facts: dict):
    path = home.parent / f"{home.name}.yaml"
    path.write_text(cluster_text(True, False))
    cluster = account.resolved(load_cluster(path), {"phone": user_layout(home),
                                                    "gpubox": LINUX})
    path.unlink()
    return HostContext(cluster, cluster.host("phone"), facts, run_values())


def as_user(args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}",
                           "--clear-groups", "--no-new-privs", *args], capture_output=True,
                          text=True, cwd="/", **kw)


def probe(home: Path, cache_dir: str) -> dict | None:
    out = as_user(["sh", "-c", CacheDir().command(path=cache_dir, as_user=True)], check=True)
    return CacheDir().process(out.stdout.splitlines())


def seed_step(home: Path, tensors):
    layout = user_layout(home)
    cache_dir = d.cache_dir_for(layout, 50052)
    ctx = user_ctx(home, {"rpc_cache.CacheDir[50052]": probe(home, cache_dir)})
    return ops.seed(ctx, 50052, str(home / "m.gguf"), tensors, cache_dir, SHA), cache_dir


def apply_as_user(home: Path, tensors) -> tuple[list, Path]:
    step, cache_dir = seed_step(home, tensors)
    return [as_user(["sh", "-c", c]) for c in step.commands], Path(cache_dir)


def check_cache(cache: Path, wanted: dict) -> None:
    assert cache.is_dir() and not cache.is_symlink()
    assert cache.stat().st_uid == NOBODY.pw_uid
    for name, data in wanted.items():
        assert not (cache / name).is_symlink() and (cache / name).read_bytes() == data, name
    marker = cache / d.rpc_cache_marker
    assert sorted(line.split()[3] for line in marker.read_text().splitlines()) == sorted(wanted)


def _hashes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


@needs_user
def test_the_seed_runs_as_the_user_into_its_own_folder_then_plans_nothing(home, synthetic):  # noqa: F811
    tensors = [t for t in T.weight_tensors(synthetic) if t.layer in (0, 1)]
    step, _ = seed_step(home, tensors)
    (command,) = step.commands
    assert "systemd-run" not in command and "setpriv" not in command
    ran, cache = apply_as_user(home, tensors)
    assert [r.returncode for r in ran] == [0], [r.stderr for r in ran]
    check_cache(cache, _wanted(home / "m.gguf", tensors))
    assert (cache.parent.stat().st_mode & 0o777) == 0o700  # the rpc-server's LLAMA_CACHE
    assert (cache.stat().st_mode & 0o777) == 0o700
    # The probe, as the user, reads the marker it wrote: the next plan is a no-op.
    again, _ = seed_step(home, tensors)
    assert again.noop, again.change.reason


@needs_user
def test_links_planted_in_the_cache_are_never_followed(home, synthetic):  # noqa: F811
    """The rpc-server runs as the same user; confined by its manager to its cache folder, it
    can still plant links there: at the rpc/ folder, at every name the seed writes, dangling
    ones. The seed writes none of the files they point at (here: the user's other files)."""
    tensors = [t for t in T.weight_tensors(synthetic) if t.layer in (0, 1)]
    wanted = _wanted(home / "m.gguf", tensors)
    victims = home / "victims"  # the user's files outside the cache: ~/.ssh, ~/.bashrc
    victims.mkdir()
    layout = user_layout(home)
    cache = Path(d.cache_dir_for(layout, 50052))
    cache.mkdir(parents=True)
    names = [d.rpc_cache_marker, f"{d.rpc_cache_marker}.tmp"] + [f".{n}.tmp" for n in wanted] \
        + list(wanted)
    for i, name in enumerate(names):
        (victims / f"file-{i}").write_text(f"victim {i}\n")
        (cache / name).symlink_to(victims / f"file-{i}")
        (cache / f".{name}.dangling").symlink_to(victims / f"created-{i}")
    for path in [victims, *victims.rglob("*"), *Path(layout.cache).rglob("*")]:
        os.lchown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    before = _hashes(victims)
    ran, cache = apply_as_user(home, tensors)
    assert [r.returncode for r in ran] == [0], [r.stderr for r in ran]
    assert _hashes(victims) == before and not list(victims.glob("created-*"))
    check_cache(cache, wanted)


@needs_user
@pytest.mark.parametrize("where", ["rpc", "cache folder"])
def test_a_link_where_a_cache_folder_belongs_is_replaced(home, synthetic, where):  # noqa: F811
    tensors = [t for t in T.weight_tensors(synthetic) if t.layer == 0]
    elsewhere = home / "elsewhere"  # a folder of the user's with entry-like names
    elsewhere.mkdir()
    for name in ("0123456789abcdef", "fedcba9876543210"):
        (elsewhere / name).write_text("keep me\n")
    layout = user_layout(home)
    cache = Path(d.cache_dir_for(layout, 50052))
    link = cache if where == "rpc" else cache.parent
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere)
    for path in [elsewhere, *elsewhere.iterdir(), *Path(layout.cache).rglob("*")]:
        os.lchown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    before = _hashes(elsewhere)
    ran, cache = apply_as_user(home, tensors)
    assert [r.returncode for r in ran] == [0], [r.stderr for r in ran]
    assert _hashes(elsewhere) == before and sorted(os.listdir(elsewhere)) == sorted(before)
    assert f"removed a link (or file) where the cache folder {link} belongs" in ran[0].stderr
    check_cache(cache, _wanted(home / "m.gguf", tensors))


@needs_user
def test_the_probe_reads_the_users_marker_as_the_user(home):
    """As the user, without setpriv: a marker that is a link to a file the user may not read
    (root's) gives nothing; its own marker is read (the root probe's setpriv would fail here:
    an unprivileged user cannot clear its groups)."""
    cache = Path(d.cache_dir_for(user_layout(home), 50052))
    cache.mkdir(parents=True)
    for path in [cache.parent.parent, cache.parent, cache]:
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    line = f"{SHA} 1000 12582912 f42cfb619b3cade9\n"
    secret = home / "root-only"
    secret.write_text(line)
    os.chown(secret, 0, 0)
    secret.chmod(0o600)
    marker = cache / d.rpc_cache_marker
    marker.write_text(line)
    os.chown(marker, NOBODY.pw_uid, NOBODY.pw_gid)
    assert probe(home, str(cache))["marker"] == [(SHA, 1000, 12582912, "f42cfb619b3cade9")]
    root_probe = as_user(["sh", "-c", CacheDir().command(path=str(cache))])
    assert "marker " not in root_probe.stdout  # what the rootless branch is for
    marker.unlink()
    marker.symlink_to(secret)
    os.lchown(marker, NOBODY.pw_uid, NOBODY.pw_gid)
    assert probe(home, str(cache)).get("damaged") == ["the marker is a symbolic link; not read"]


@needs_user
def test_a_seed_stopped_mid_way_ends_with_its_process_group(home, synthetic):  # noqa: F811
    """No unit to stop on a rootless host: the seed runs in the guarded step's own session, and
    inflight's stop script (Ctrl-C twice, a dead run's lock taken over) ends it with the
    fetches it started. Here a fetch from an md-share that never answers keeps it busy."""
    layout = user_layout(home)
    tensors = [t for t in T.weight_tensors(synthetic) if t.layer == 0 and t.hashed]
    import socket

    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/models/{SHA}"
    fetch = (ops.SeedModel("", SHA, tuple(tensors), "gemma", "node1"), url,
             [(t.offset, t.size, "0" * 16, "0" * 64) for t in tensors])
    body = ops._seed_script(f"{layout.prefix}/tools/md-rpc-seed", d.cache_dir_for(layout, 50052),
                            [], [], [fetch])
    command = inflight.guarded("rpc_cache.seed[50052]",
                               ops.as_login_user(f"{layout.cache}/meshdeploy-rpc-50052", body),
                               layout)
    assert inflight.steps_dir(layout).startswith(layout.run)  # the user's, not /run/meshdeploy
    proc = subprocess.Popen(["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}",
                             "--clear-groups", "--no-new-privs", "sh", "-c", command],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        deadline = time.monotonic() + 20
        while not _curls(str(silent.getsockname()[1])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _curls(str(silent.getsockname()[1])), "the seed never started its fetch"
        stopped = as_user(["sh", "-c", inflight.stop_script(grace=5, layout=layout)],
                          timeout=30)
        assert inflight.parse_stopped(stopped.stdout.splitlines()) == ["rpc_cache.seed[50052]"]
        proc.wait(10)
        assert proc.returncode != 0
        assert not _curls(str(silent.getsockname()[1])), "a fetch outlived its step"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        silent.close()
    # What is left is what a later run clears: no entry, no marker.
    cache = Path(d.cache_dir_for(layout, 50052))
    assert not (cache / d.rpc_cache_marker).exists()


def _curls(port: str) -> list[int]:
    """Pids of the user's curl processes that fetch from `port`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = stat.read_bytes().split(b"\0")
            uid = stat.parent.stat().st_uid
        except OSError:
            continue
        if uid == NOBODY.pw_uid and argv and argv[0].endswith(b"curl") and \
                any(f":{port}/".encode() in a for a in argv):
            out.append(int(stat.parent.name))
    return out


def test_a_seed_on_a_root_host_is_still_the_service_users_unit(tmp_path):
    """The host with root keeps its seed unit (seed-as-service.sh): nothing rootless leaks."""
    from test_rpc_cache import ctx_for

    tensors = [T.Tensor("blk.0.ffn_up.weight", 1000, 12 << 20, 0)]
    step = ops.seed(ctx_for({}), 50052, "/m.gguf", tensors,
                    "/var/cache/meshdeploy-rpc-50052/rpc", SHA)
    (command,) = step.commands
    assert "md_systemd_run" in command and "-p DynamicUser=yes" in command
    assert "umask 077" not in command
    section = next(s for s in ops.sections(ctx_for({}).cluster, ctx_for({}).host)
                   if s.key.startswith("rpc_cache.CacheDir"))
    assert section.privileged and "as_user" not in section.kwargs
    assert "setpriv --reuid" in section.fact().command(**section.kwargs)

