"""Workers fetch only their tensors: the seeding script's fetch path, run for real.

md-share (templates/md-share.py) serves a file on loopback, md-rpc-seed --digest makes the
digest list from it, and the script rpc_cache.seed renders fetches the listed byte ranges into a
cache dir through curl and md-rpc-seed --receive, in parallel lanes. A tensor whose bytes do not
match its digest is never put in place.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_md_share import free_port

from meshdeploy.core.share import SERVER
from meshdeploy.roles.models import operations as models
from meshdeploy.roles.rpc_cache import defaults as d
from meshdeploy.roles.rpc_cache import operations as ops

MiB = 1024 * 1024
SHA = "a" * 64


@pytest.fixture
def served(tmp_path):
    """A 9 MiB file with four "tensors" (two with equal bytes), served by md-share."""
    rng = os.urandom
    same = rng(2 * MiB)
    layout = [(4096, rng(3 * MiB)), (4096 + 3 * MiB, same), (4096 + 5 * MiB, rng(MiB + 7)),
              (4096 + 7 * MiB, same)]
    blob = bytearray(rng(9 * MiB + 4096))
    for off, data in layout:
        blob[off:off + len(data)] = data
    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(blob))
    port = free_port()
    pid = tmp_path / "share.pid"
    proc = subprocess.Popen([sys.executable, str(SERVER), "--bind", "127.0.0.1", "--port",
                             str(port), "--allow", "127.0.0.1", "--file", f"m={path}",
                             "--idle", "30", "--max", "120", "--pid-file", str(pid),
                             "--log", str(tmp_path / "share.log")])
    deadline = time.monotonic() + 10
    while not pid.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    yield path, [(off, len(data)) for off, data in layout], f"http://127.0.0.1:{port}/models/m"
    proc.terminate()
    proc.wait(10)


def digests(tool: Path, path: Path, ranges) -> list[tuple]:
    out = subprocess.run([str(tool), "--digest", str(path)], input="".join(
        f"{o} {s}\n" for o, s in ranges), capture_output=True, text=True, check=True).stdout
    return [(int(o), int(s), f, h) for o, s, f, h in (line.split() for line in out.splitlines())]


def run(tool: Path, cache: Path, url: str, lines) -> subprocess.CompletedProcess:
    model = ops.SeedModel("", SHA, (), "m", "node1")
    script = ops._seed_script(str(tool), str(cache), [], [], [(model, url, lines)])
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120)


def test_fetched_entries_are_the_listed_bytes(seed_bin, served, tmp_path):
    path, ranges, url = served
    lines = digests(seed_bin, path, ranges)
    assert lines[1][2] == lines[3][2]  # equal bytes, one entry
    cache = tmp_path / "cache"
    done = run(seed_bin, cache, url, lines)
    assert done.returncode == 0, done.stderr
    data = path.read_bytes()
    names = sorted(p.name for p in cache.iterdir())
    assert names == sorted({f for _, _, f, _ in lines} | {d.rpc_cache_marker})
    for off, size, fnv, sha in lines:
        entry = (cache / fnv).read_bytes()
        assert entry == data[off:off + size] and hashlib.sha256(entry).hexdigest() == sha
    marker = sorted(tuple(line.split()) for line in
                    (cache / d.rpc_cache_marker).read_text().splitlines())
    assert marker == sorted((SHA, str(o), str(s), f) for o, s, f, _ in lines)
    # Each distinct tensor crossed once, as a ranged GET (206), however many lanes ran.
    log = [w for w in (line.split() for line in (tmp_path / "share.log").read_text()
                       .splitlines()) if len(w) == 7 and w[2] == "GET"]
    assert sorted((int(w[5]), int(w[6])) for w in log) == sorted(
        {(o, s) for o, s, f, _ in lines if (o, s) != (ranges[3][0], ranges[3][1])})
    assert {w[4] for w in log} == {"206"}


def test_a_tensor_that_does_not_match_its_digest_is_never_cached(seed_bin, served, tmp_path):
    path, ranges, url = served
    lines = digests(seed_bin, path, ranges)
    off, size, fnv, sha = lines[0]
    lines[0] = (off, size, fnv, "0" * 64)  # the file's bytes, but not what the list promises
    cache = tmp_path / "cache"
    failed = run(seed_bin, cache, url, lines)
    assert failed.returncode != 0
    assert "not fetched" in failed.stderr and "SHA-256" in failed.stderr, failed.stderr
    assert not (cache / fnv).exists()
    # No partial entry either: what is unfinished stays in the run's work folder, which the
    # next run removes.
    assert [p.name for p in cache.iterdir() if p.name.endswith(".tmp")] == []
    assert [p.name.split(".")[1] for p in cache.iterdir() if p.name.startswith(".")] == [
        "meshdeploy-work"]
    assert not (cache / d.rpc_cache_marker).exists()  # the marker is only renamed at the end


def _md_share(tmp_path: Path, port: int, *args: str) -> subprocess.Popen:
    pid = tmp_path / f"share-{time.monotonic_ns()}.pid"
    proc = subprocess.Popen([sys.executable, str(SERVER), "--bind", "127.0.0.1", "--port",
                             str(port), "--allow", "127.0.0.1", "--idle", "30", "--max", "120",
                             "--pid-file", str(pid), *args],
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not pid.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    return proc


def test_a_copy_trails_the_download_and_outlives_a_restart_of_md_share(tmp_path):
    """models.gguf on a host that copies: the source's partial is served as it grows, and when
    md-share is restarted under the copy (the source's next step does that), the copy resumes
    where it was cut and ends whole and verified."""
    data = os.urandom(6 * MiB + 5)
    source = tmp_path / "source"
    source.mkdir()
    final, partial = source / "m.gguf", source / "m.gguf.part"
    partial.write_bytes(data[:MiB])
    port = free_port()
    files = ["--file", f"m={final}", "--growing", f"m={partial}:{len(data)}", "--wait", "20"]
    server = [_md_share(tmp_path, port, *files)]

    def download():  # the source's own download, 512 KiB every 0.1 s, then the rename
        with open(partial, "ab") as f:
            for i in range(MiB, len(data), MiB // 2):
                time.sleep(0.1)
                f.write(data[i:i + MiB // 2])
                f.flush()
                if i >= 3 * MiB and len(server) == 1:  # mid-copy: md-share restarted
                    server[0].terminate()
                    server[0].wait(10)
                    server.append(_md_share(tmp_path, port, *files))
        partial.rename(final)
    writer = threading.Thread(target=download)
    target = tmp_path / "copy" / "m.gguf"
    script = models.download_script(str(target), f"http://127.0.0.1:{port}/models/m", len(data),
                                    hashlib.sha256(data).hexdigest(), lan=True)
    writer.start()
    try:
        done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120)
    finally:
        writer.join()
        for proc in server:
            proc.terminate()
            proc.wait(10)
    assert len(server) == 2  # the restart did happen during the copy
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == data
