"""The seeding step against a cache folder its rpc-server's user has prepared (issue: root never
works where a service can write).

rpc-server is an unauthenticated network service that owns its cache folder, so whoever takes it
over can plant links there before the next apply seeds. These tests run the step's commands for
real (the host's path without systemd: the script seeds as whoever runs it) against a folder with
a link at every name the step writes, and at the folder itself, and check that nothing outside
the folder changed and the cache is right. On systemd hosts the same script runs as the
rpc-server's own user (tests/lab/test_seeding.py plants the links there as that user).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from support.require import needs
from test_rpc_cache import SHA, ctx_for, fnv1a, synthetic  # noqa: F401 (fixture)

from meshdeploy.core import transient
from meshdeploy.placement import tensors as T
from meshdeploy.roles.rpc_cache import defaults as d
from meshdeploy.roles.rpc_cache import operations as ops
from meshdeploy.roles.rpc_cache.facts import CacheDir


def _hashes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def _apply(seed_bin: Path, gguf: Path, cache: Path, tensors, prefix: Path):
    """Plan the seed step from the folder's fact, then run its commands as the host would."""
    tool = prefix / "tools" / "md-rpc-seed"
    tool.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(seed_bin, tool)
    out = subprocess.run(["sh", "-c", CacheDir().command(path=str(cache))],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    step = ops.seed(ctx_for({"rpc_cache.CacheDir[50052]": CacheDir().process(out)}), 50052,
                    str(gguf), tensors, str(cache), SHA)
    return [subprocess.run(["sh", "-c", c.replace(ops.tool_path("/opt/meshdeploy"), str(tool))],
                           capture_output=True, text=True) for c in step.commands]


def _wanted(gguf: Path, tensors) -> dict:
    data = gguf.read_bytes()
    return {fnv1a(data[t.offset:t.offset + t.size]): data[t.offset:t.offset + t.size]
            for t in tensors if t.hashed}


def _check_cache(cache: Path, wanted: dict) -> None:
    assert cache.is_dir() and not cache.is_symlink()
    for name, data in wanted.items():
        entry = cache / name
        assert not entry.is_symlink() and entry.read_bytes() == data, name
    marker = (cache / d.rpc_cache_marker)
    assert not marker.is_symlink()
    assert sorted(line.split()[3] for line in marker.read_text().splitlines()) == sorted(wanted)


def test_links_at_every_name_the_step_writes_are_never_followed(seed_bin, synthetic, tmp_path):
    tensors = [t for t in T.weight_tensors(synthetic) if t.layer in (0, 1)]
    wanted = _wanted(synthetic, tensors)
    victims = tmp_path / "victims"  # stands for /etc, /root: files the seeder could write
    victims.mkdir()
    cache = tmp_path / "var-cache" / "rpc"
    cache.mkdir(parents=True)
    names = [d.rpc_cache_marker, f"{d.rpc_cache_marker}.tmp", ".meshdeploy-seed-list",
             ".meshdeploy-seed-list.out", ".meshdeploy-seed-list.0", ".meshdeploy-seed-list.0.m"]
    names += [f".{n}.tmp" for n in wanted] + list(wanted)
    for i, name in enumerate(names):
        victim = victims / f"file-{i}"
        victim.write_text(f"victim {i}\n")
        (cache / name).symlink_to(victim)
        # A dangling link: following it would create a file of the attacker's choosing.
        (cache / f".{name}.dangling").symlink_to(victims / f"created-{i}")
    before = _hashes(victims)
    ran = _apply(seed_bin, synthetic, cache, tensors, tmp_path / "prefix")
    assert [r.returncode for r in ran] == [0], [r.stderr for r in ran]
    assert _hashes(victims) == before
    assert not list(victims.glob("created-*"))
    _check_cache(cache, wanted)


def test_links_planted_while_the_step_runs_are_never_followed(seed_bin, synthetic, tmp_path):
    """The rpc-server runs while its cache is seeded: it can plant a link at a temporary's name
    after the step cleared it and before md-rpc-seed opens it. Written through, that link would
    truncate and overwrite root's file; now the open refuses it (the step may fail: it never
    writes elsewhere)."""
    tensors = [t for t in T.weight_tensors(synthetic) if t.layer in (0, 1, 2)]
    wanted = _wanted(synthetic, tensors)
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    cache = tmp_path / "var-cache" / "rpc"
    cache.mkdir(parents=True)
    stop = threading.Event()

    def plant():
        while not stop.is_set():
            for name in wanted:
                try:
                    (cache / f".{name}.tmp").symlink_to(victim)
                except (FileExistsError, FileNotFoundError):
                    pass

    planter = threading.Thread(target=plant)
    planter.start()
    try:
        ran = _apply(seed_bin, synthetic, cache, tensors, tmp_path / "prefix")
    finally:
        stop.set()
        planter.join()
    assert victim.read_text() == "root's file\n", "the seeding step wrote through a link"
    if ran[0].returncode == 0:
        _check_cache(cache, wanted)
    else:
        assert "File exists" in ran[0].stderr or "link" in ran[0].stderr, ran[0].stderr


def test_a_link_where_the_cache_folder_belongs_is_replaced(seed_bin, synthetic, tmp_path):
    tensors = [t for t in T.weight_tensors(synthetic) if t.layer == 0]
    wanted = _wanted(synthetic, tensors)
    elsewhere = tmp_path / "root-only"  # a folder with entry-like names the old step deleted
    elsewhere.mkdir()
    for name in ("0123456789abcdef", "fedcba9876543210"):
        (elsewhere / name).write_text("keep me\n")
    before = _hashes(elsewhere)
    cache = tmp_path / "var-cache" / "rpc"
    cache.parent.mkdir()
    cache.symlink_to(elsewhere)
    ran = _apply(seed_bin, synthetic, cache, tensors, tmp_path / "prefix")
    assert [r.returncode for r in ran] == [0], [r.stderr for r in ran]
    assert _hashes(elsewhere) == before and sorted(os.listdir(elsewhere)) == sorted(before)
    assert "removed a link (or file) where the cache folder" in ran[0].stderr
    _check_cache(cache, wanted)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_root_refuses_a_folder_another_user_owns(seed_bin, synthetic, tmp_path):
    """Without systemd the step runs as whoever runs it: as root it writes nothing into a folder
    that another user (the rpc-server's, were it a DynamicUser) owns."""
    tensors = [t for t in T.weight_tensors(synthetic) if t.layer == 0]
    cache = tmp_path / "var-cache" / "rpc"
    cache.mkdir(parents=True)
    tmp_path.chmod(0o755)
    os.chown(cache.parent, 65534, 65534)
    os.chown(cache, 65534, 65534)
    ran = _apply(seed_bin, synthetic, cache, tensors, tmp_path / "prefix")
    assert ran[0].returncode != 0
    assert "belongs to uid 65534, not to uid 0 that seeds it" in ran[0].stderr
    assert os.listdir(cache) == []


def test_a_linked_folder_or_a_damaged_marker_is_rewritten():
    """The CacheDir fact reports what the rpc-server's user left; the plan rewrites it even when
    the lines it could read say the cache is complete."""
    tensors = [T.Tensor("blk.0.ffn_up.weight", 1000, 12 << 20, 0)]
    done = {"entries": {"f42cfb619b3cade9": 12 << 20}, "temporary": [],
            "marker": [(SHA, 1000, 12 << 20, "f42cfb619b3cade9")]}

    def step(fact):
        return ops.seed(ctx_for({"rpc_cache.CacheDir[50052]": fact}), 50052, "/m.gguf", tensors,
                        "/var/cache/meshdeploy-rpc-50052/rpc", SHA)

    assert step(done).noop
    damaged = step({**done, "damaged": ["line 2: 'x 1 ³ f42cfb619b3cade9'"]})
    assert not damaged.noop and "rewritten" in str(damaged.change.diffs)
    linked = step({"entries": {}, "temporary": [], "marker": [], "link": True})
    assert linked.change.action == "create"
    assert "a symbolic link (never followed)" in str(linked.change.diffs)


def _systemd_stubs(bin_dir: Path) -> None:
    """systemd-run and systemctl as the wrapper meets them on a systemd host: systemd-run records
    its words, then runs the command after `--` as systemd would ("$$" read as "$"), here as the
    test's own user."""
    bin_dir.mkdir()
    # Each call is counted; while a file `refuse` is there, the call removes it and fails as a
    # start systemd gave up on does (exit 1, the command never run, no "Started" in its log).
    (bin_dir / "systemd-run").write_text(
        '#!/bin/sh\nd=${0%/*}\nfor a; do printf "%s\\n" "$a"; done > "$d/run.args"\n'
        'echo call >> "$d/run.calls"\n'
        'if [ -e "$d/refuse" ]; then rm "$d/refuse"; echo "Starting unit..." >> "$d/journal"\n'
        '  echo "unit: start operation timed out. Terminating." >> "$d/journal"; exit 1; fi\n'
        'echo "Started unit." >> "$d/journal"\n'
        'while [ "$1" != -- ]; do shift; done; shift\n'
        'set -- $(printf "%s\\n" "$@" | sed "s/[$][$]/$/g")\nexec "$@"\n')
    (bin_dir / "systemctl").write_text('#!/bin/sh\necho "$*" >> "${0%/*}/systemctl.calls"\n')
    (bin_dir / "journalctl").write_text('#!/bin/sh\ncat "${0%/*}/journal" 2>/dev/null; '
                                        ': > "${0%/*}/journal"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)


def _on_systemd(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """The wrapper's systemd branch taken (a BOOTED folder, the stubs first on PATH): (the
    folder root keeps the scripts in, the stubs' folder)."""
    booted, rundir, stubs = tmp_path / "booted", tmp_path / "run" / "seed", tmp_path / "bin"
    booted.mkdir()
    _systemd_stubs(stubs)
    monkeypatch.setattr(transient, "BOOTED", str(booted))
    monkeypatch.setattr(ops, "RUNDIR", str(rundir))
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    return rundir, stubs


def test_on_systemd_it_runs_in_a_transient_unit_with_the_rpc_servers_user(seed_bin, synthetic,
                                                                            tmp_path, monkeypatch):
    """The systemd branch of seed-as-service.sh, with systemd-run stubbed: the unit gets the
    rpc-server's user and CacheDirectory and the sandbox, the script from a file root keeps
    (gone afterwards), and the seeding's exit status comes back."""
    rundir, stubs = _on_systemd(tmp_path, monkeypatch)
    tensors = [t for t in T.weight_tensors(synthetic) if t.layer == 0]
    cache = tmp_path / "var-cache" / "rpc"
    ran = _apply(seed_bin, synthetic, cache, tensors, tmp_path / "prefix")
    assert [r.returncode for r in ran] == [0], [r.stderr for r in ran]
    _check_cache(cache, _wanted(synthetic, tensors))
    argv = (stubs / "run.args").read_text().splitlines()
    props = [argv[i + 1] for i, a in enumerate(argv) if a == "-p"]
    assert props == ops.seed_properties(50052)
    assert "IPAddressDeny=any" in props and "CacheDirectory=meshdeploy-rpc-50052" in props
    assert {"--wait", "--pipe", "--collect", "--unit=meshdeploy-rpc-50052-seed"} <= set(argv)
    assert argv[-3:-1] == ["--", "/bin/sh"] and argv[-1].startswith(str(rundir))
    assert os.listdir(rundir) == []  # the script file is gone
    assert (stubs / "systemctl.calls").read_text().startswith("stop meshdeploy-rpc-50052-seed")
    # A seeding that fails fails the step: the GGUF gone, md-rpc-seed exits non-zero.
    shutil.rmtree(cache)
    gone = tmp_path / "gone.gguf"
    calls = len((stubs / "run.calls").read_text().splitlines())
    ran = _apply(seed_bin, gone, cache, tensors, tmp_path / "prefix")
    assert ran[0].returncode != 0 and "gone.gguf" in ran[0].stderr
    # It ran and failed: not tried again, and the step shows systemd's log of the unit.
    assert len((stubs / "run.calls").read_text().splitlines()) == calls + 1
    assert "ended with status 1; systemd's log of it:\n  Started unit." in ran[0].stderr


def test_a_seed_unit_that_never_started_is_tried_once_more(seed_bin, synthetic, tmp_path,
                                                          monkeypatch):
    """systemd-run --quiet fails without a word when systemd gives up on a start before the
    script runs: the wrapper sees no "Started" in systemd's log of the unit, says so with that
    log, and starts it once more; a second such failure fails the step."""
    rundir, stubs = _on_systemd(tmp_path, monkeypatch)
    tensors = [t for t in T.weight_tensors(synthetic) if t.layer == 0]
    cache = tmp_path / "var-cache" / "rpc"
    (stubs / "refuse").touch()
    ran = _apply(seed_bin, synthetic, cache, tensors, tmp_path / "prefix")
    assert [r.returncode for r in ran] == [0], [r.stderr for r in ran]
    assert len((stubs / "run.calls").read_text().splitlines()) == 2
    assert "did not start (status 1); trying once more" in ran[0].stderr
    assert "start operation timed out" in ran[0].stderr
    _check_cache(cache, _wanted(synthetic, tensors))
    assert os.listdir(rundir) == []
    # Refused twice: the step fails, after two starts, with systemd's log.
    shutil.rmtree(cache)
    (stubs / "run.calls").unlink()
    (stubs / "journal").write_text("")  # what journalctl --since shows: this start's lines
    (stubs / "refuse").touch()
    refuse_again = stubs / "systemd-run"
    text = refuse_again.read_text()
    refuse_again.write_text(text.replace('rm "$d/refuse"; ', ''))  # refuses every time now
    ran = _apply(seed_bin, synthetic, cache, tensors, tmp_path / "prefix")
    assert ran[0].returncode == 1
    assert len((stubs / "run.calls").read_text().splitlines()) == 2
    assert "ended with status 1; systemd's log of it:" in ran[0].stderr
    assert not (cache / d.rpc_cache_marker).exists()


def test_a_seed_unit_may_reach_only_the_host_it_fetches_from():
    props = ops.seed_properties(50052, ["10.200.0.11", "10.200.0.11", "fd00::1"])
    assert props[-2:] == ["IPAddressDeny=any", "IPAddressAllow=10.200.0.11 fd00::1"]
    # IPAddressAllow= takes no names: a source given by name leaves the addresses open.
    assert not any(p.startswith("IPAddress") for p in ops.seed_properties(50052, ["node1.lan"]))


@pytest.mark.skipif(os.geteuid() != 0, reason="a folder of another user's, read by root")
@needs("setpriv")
def test_the_probe_reads_a_service_users_marker_as_that_user(tmp_path):
    """The probe runs as root; the marker is the rpc-server's to write, and it can swap in a link
    to a file only root may read after the probe checked it is a plain file. Read as the folder's
    owner, such a file gives nothing (here: a root-only file under the marker's name)."""
    cache = tmp_path / "var-cache" / "rpc"
    cache.mkdir(parents=True)
    tmp_path.chmod(0o755)
    (tmp_path / "var-cache").chmod(0o755)
    os.chown(cache, 65534, 65534)
    line = f"{SHA} 1000 12582912 f42cfb619b3cade9\n"
    secret = cache / d.rpc_cache_marker
    secret.write_text(line)
    secret.chmod(0o600)  # root's alone, as /etc/shadow would be
    out = subprocess.run(["sh", "-c", CacheDir().command(path=str(cache))],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert CacheDir().process(out)["marker"] == []
    os.chown(secret, 65534, 65534)  # the owner's own marker is read as before
    out = subprocess.run(["sh", "-c", CacheDir().command(path=str(cache))],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert CacheDir().process(out)["marker"] == [(SHA, 1000, 12582912, "f42cfb619b3cade9")]
