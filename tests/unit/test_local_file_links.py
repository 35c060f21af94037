"""Files meshdeploy writes beside the cluster file never write through a link planted there.

Whoever can write the cluster file's folder (a shared checkout, a synced folder) could plant a
link at a name meshdeploy writes: before, `<stem>.speed.json`, the lock file and the bench file
were written through the fixed name `<name>.tmp`, so a link there made meshdeploy write JSON
into any file the operator can write (a shell start-up file: a server name that is a command
ran when it was sourced), and the control lock `<stem>.state.lock` was opened and truncated
through a link at its own name. Each writer goes through core.files.write_atomic (a temporary
file made with O_EXCL, renamed over the name: a link at the final name is replaced, never
written through), the control lock is opened with O_NOFOLLOW. Every case plants links at the
old temporary name and at the final name and checks the file they point at is unchanged.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshdeploy.core import files
from meshdeploy.engine import locks, speeds
from meshdeploy.errors import MeshdeployError
from meshdeploy.roles.llama_cpp import lock as llama_lock
from meshdeploy.roles.rpc_cache import seeding
from meshdeploy.views import bench

PRECIOUS = "export PATH=/usr/bin  # the operator's own file\n"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _speed(cluster: Path) -> Path:
    return speeds.write(cluster, "chat", {"devices": ["x"], "seconds_per_byte": 1e-9})


def _lock(cluster: Path) -> Path:
    llama_lock.write_lock(cluster, "https://github.com/ggml-org/llama.cpp", "b1", COMMIT)
    return llama_lock.lock_path(cluster)


def _bench(cluster: Path) -> Path:
    return bench.write_state(cluster, [{"server": "chat", "time": "t", "overall": {}}])


WRITERS = {"speed": (_speed, speeds.path),
           "lock": (_lock, llama_lock.lock_path),
           "bench": (_bench, bench.state_path)}


@pytest.fixture
def cluster(tmp_path: Path) -> Path:
    folder = tmp_path / "shared"
    folder.mkdir()
    path = folder / "lab.yaml"
    path.write_text("cluster: lab\n")
    return path


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "home" / ".bashrc"
    path.parent.mkdir()
    path.write_text(PRECIOUS)
    path.chmod(0o600)
    return path


def _untouched(victim: Path) -> None:
    assert victim.read_text() == PRECIOUS
    assert victim.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_a_link_at_the_old_temporary_name_is_not_followed(kind, cluster, victim):
    write, final = WRITERS[kind]
    planted = final(cluster).with_name(final(cluster).name + ".tmp")
    planted.symlink_to(victim)
    written = write(cluster)
    _untouched(victim)
    assert not written.is_symlink()
    assert json.loads(written.read_text())  # the file itself was written, whole


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_a_link_at_the_final_name_is_replaced_not_written_through(kind, cluster, victim):
    write, final = WRITERS[kind]
    final(cluster).symlink_to(victim)
    written = write(cluster)
    _untouched(victim)
    assert not written.is_symlink() and written.is_file()
    assert json.loads(written.read_text())


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_no_temporary_file_is_left_behind(kind, cluster):
    write, _ = WRITERS[kind]
    written = write(cluster)
    assert sorted(p.name for p in cluster.parent.iterdir()) == sorted([cluster.name, written.name])


def test_the_temporary_file_swapped_for_a_link_after_its_write(cluster, victim, monkeypatch):
    """The mode is set on the open file, not by name: a link swapped in at the temporary name
    once the bytes are written (here at the fsync) cannot make the operator's file
    world-readable through a chmod by name that came later."""
    real_fsync = os.fsync

    def swap(fd):
        real_fsync(fd)
        for tmp in cluster.parent.glob(".*.tmp"):
            tmp.rename(tmp.with_name("moved-away"))
            tmp.symlink_to(victim)
    monkeypatch.setattr(os, "fsync", swap)
    files.write_atomic(cluster.with_name("lab.speed.json"), "{}\n", 0o644)
    _untouched(victim)


def test_the_control_lock_is_not_opened_through_a_link(cluster, victim):
    locks.lock_path(cluster).symlink_to(victim)
    lock = locks.ControlLock(cluster, locks.me("apply"))
    with pytest.raises(MeshdeployError, match="not a regular file"):
        lock.acquire()
    _untouched(victim)


def test_the_control_lock_refuses_a_hard_link(cluster, victim):
    os.link(victim, locks.lock_path(cluster))
    lock = locks.ControlLock(cluster, locks.me("apply"))
    with pytest.raises(MeshdeployError, match="more than one name"):
        lock.acquire()
    _untouched(victim)


def test_the_control_lock_still_locks(cluster):
    with locks.ControlLock(cluster, locks.me("apply")):
        second = locks.ControlLock(cluster, locks.me("plan"))
        with pytest.raises(locks.LockedError):
            second.acquire()
    with locks.ControlLock(cluster, locks.me("apply")):
        pass


def test_the_gguf_header_cache_is_not_written_through_a_link(tmp_path, victim):
    """The control machine's cache of GGUF headers (rpc_cache seeding): its folder is the
    operator's, but the rule is the same everywhere."""
    cache = tmp_path / "cache"
    cache.mkdir()
    key = "ab" * 32
    (cache / f"{key}.tmp").symlink_to(victim)

    def produce(dest):
        with open(dest, "wb") as f:  # as tensors.fetch writes
            f.write(b"not a gguf")
        return dest
    with pytest.raises(MeshdeployError, match="cannot read the GGUF header"):
        seeding._kept(cache, key, produce, "models.m", "check it")
    _untouched(victim)
    assert sorted(p.name for p in cache.iterdir()) == [f"{key}.tmp"]  # nothing left but the link
