"""md-rpc-seed --digest and --receive, compiled and run here: SHA-256 and FNV-1a against Python
references, and --receive putting an entry in place only for the exact bytes announced."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
from pathlib import Path

import pytest

from conftest import build_seed_tool

MiB = 1024 * 1024
# Block-boundary sizes for SHA-256 (55/56: the length still fits the last block or not) and one
# range larger than --receive's 1 MiB read buffer and fnv1a_sha256's whole-block run.
SIZES = (0, 1, 55, 56, 63, 64, 65, 1000, 3 * MiB + 17)


def fnv1a(data: bytes) -> str:
    """Reference FNV-1a 64 (ggml-rpc.cpp fnv_hash), as the cache names entries."""
    h = 0xcbf29ce484222325
    mask = (1 << 64) - 1
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & mask
    return f"{h:016x}"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, bytes]:
    data = random.Random(1).randbytes(4 * MiB)
    path = tmp_path_factory.mktemp("src") / "random.bin"
    path.write_bytes(data)
    return path, data


@pytest.fixture(scope="module")
def ranges() -> list[tuple[int, int]]:
    # Odd offsets: ranges start off every page and block boundary.
    return [(1 + 98 * i, size) for i, size in enumerate(SIZES)]


def digest(tool: Path, path: Path, listing: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool), "--digest", str(path)], input=listing, text=True,
                          capture_output=True)


def expected_lines(data: bytes, ranges) -> list[str]:
    return [f"{o} {s} {fnv1a(data[o:o + s])} {hashlib.sha256(data[o:o + s]).hexdigest()}"
            for o, s in ranges]


# ---- --digest ----------------------------------------------------------------------------------

def test_digest_matches_hashlib_and_fnv_reference(seed_bin, source, ranges):
    path, data = source
    # A blank line is skipped, as in the seed mode.
    listing = "\n".join(f"{o} {s}" for o, s in ranges[:3]) + "\n\n" + \
        "".join(f"{o} {s}\n" for o, s in ranges[3:])
    r = digest(seed_bin, path, listing)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == expected_lines(data, ranges)
    for line in r.stdout.splitlines():
        off, size, fnv, _ = line.split()
        h = subprocess.run([str(seed_bin), "--hash", str(path), off, size], capture_output=True,
                           text=True, check=True)
        assert h.stdout == fnv + "\n"


def test_sha_extensions_and_portable_code_agree(seed_bin, source, ranges):
    """Where the CPU has the SHA extensions md-rpc-seed uses them; MD_RPC_SEED_PORTABLE=1
    forces the portable code. Both must give hashlib's answer (on a CPU without them, both runs
    take the portable code and this checks it twice)."""
    path, data = source
    listing = "".join(f"{o} {s}\n" for o, s in ranges)
    for portable in ("0", "1"):
        r = subprocess.run([str(seed_bin), "--digest", str(path)], input=listing, text=True,
                           capture_output=True, env={**os.environ, "MD_RPC_SEED_PORTABLE": portable})
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == expected_lines(data, ranges), portable


def test_digest_across_mapping_windows(tmp_path, source, ranges):
    """A 256 MiB window would need a file of gigabytes; a build with a 4099-byte one (not a
    multiple of the page or of a SHA-256 block) crosses many window edges in these ranges."""
    path, data = source
    tool = build_seed_tool(tmp_path / "md-rpc-seed-small-window", "-DWINDOW=4099")
    r = digest(tool, path, "".join(f"{o} {s}\n" for o, s in ranges))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == expected_lines(data, ranges)


@pytest.mark.parametrize("listing, message", [
    ("1 2\nx 5\n", 'stdin line 2: expected "<offset> <size>", got: x 5\n'),
    ("1 2\n1 2 3\n", 'stdin line 2: expected "<offset> <size>", got: 1 2 3\n'),
    ("1 2\n-1 5\n", 'stdin line 2: expected "<offset> <size>", got: -1 5\n'),
    ("1 2\n\n4194300 5\n", "stdin line 3: 4194300+5 is past the end of"),
])
def test_digest_rejects_bad_lines_like_seed_mode(seed_bin, source, tmp_path, listing, message):
    path, _ = source
    r = digest(seed_bin, path, listing)
    assert r.returncode == 1
    assert r.stdout.count("\n") == 1  # the good first line was answered before the bad one
    assert message in r.stderr
    (tmp_path / "cache").mkdir()
    seed = subprocess.run([str(seed_bin), str(path), str(tmp_path / "cache")], input=listing,
                          text=True, capture_output=True)
    assert seed.returncode == 1 and seed.stderr == r.stderr


def test_digest_last_byte_and_missing_file(seed_bin, source, tmp_path):
    path, data = source
    r = digest(seed_bin, path, f"{len(data) - 1} 1\n{len(data)} 0\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == expected_lines(data, [(len(data) - 1, 1), (len(data), 0)])
    gone = digest(seed_bin, tmp_path / "nope.gguf", "0 1\n")
    assert gone.returncode == 1 and "cannot open" in gone.stderr and gone.stdout == ""


# ---- --receive ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def payload() -> tuple[bytes, str, str]:
    """A tensor's bytes (more than one 1 MiB read), its FNV-1a name and its SHA-256."""
    data = random.Random(2).randbytes(2 * MiB + 333)
    return data, fnv1a(data), hashlib.sha256(data).hexdigest()


def receive(tool: Path, cache: Path, data: bytes, size: int, fnv: str, sha: str):
    return subprocess.run([str(tool), "--receive", str(cache), str(size), fnv, sha], input=data,
                          capture_output=True)


@pytest.fixture
def cache(tmp_path) -> Path:
    path = tmp_path / "cache"
    path.mkdir()
    return path


@pytest.mark.parametrize("empty", [False, True], ids=["2MiB", "empty"])
def test_receive_puts_exact_bytes_in_place(seed_bin, cache, payload, empty):
    data = b"" if empty else payload[0]
    fnv, sha = fnv1a(data), hashlib.sha256(data).hexdigest()
    r = receive(seed_bin, cache, data, len(data), fnv, sha)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == f"{fnv} {len(data)} written\n"
    assert sorted(p.name for p in cache.iterdir()) == [fnv]  # no temp file left
    assert (cache / fnv).read_bytes() == data


def test_receive_flipped_byte(seed_bin, cache, payload):
    data, fnv, sha = payload
    bad = bytearray(data)
    bad[MiB + 5] ^= 0x01
    bad = bytes(bad)
    r = receive(seed_bin, cache, bad, len(data), fnv, sha)
    assert r.returncode == 1
    assert list(cache.iterdir()) == []
    err = r.stderr.decode()
    assert f"FNV-1a of the {len(data)} bytes received is {fnv1a(bad)}, expected {fnv}" in err
    assert f"SHA-256 of the {len(data)} bytes received is {hashlib.sha256(bad).hexdigest()}, " \
           f"expected {sha}" in err


def test_receive_short_input(seed_bin, cache, payload):
    data, fnv, sha = payload
    r = receive(seed_bin, cache, data[:-1], len(data), fnv, sha)
    assert r.returncode == 1
    assert list(cache.iterdir()) == []
    assert f"received {len(data) - 1} bytes, expected {len(data)}" in r.stderr.decode()


def test_receive_extra_input(seed_bin, cache, payload):
    # The first SIZE bytes are right: only the extra byte can make it fail.
    data, fnv, sha = payload
    r = receive(seed_bin, cache, data + b"\0", len(data), fnv, sha)
    assert r.returncode == 1
    assert list(cache.iterdir()) == []
    assert f"received more than the expected {len(data)} bytes" in r.stderr.decode()


def test_receive_wrong_sha256_right_fnv(seed_bin, cache, payload):
    """The bytes, size and FNV all match: only the SHA-256 check can refuse them."""
    data, fnv, sha = payload
    wrong = hashlib.sha256(data + b"x").hexdigest()
    r = receive(seed_bin, cache, data, len(data), fnv, wrong)
    assert r.returncode == 1
    assert list(cache.iterdir()) == []
    err = r.stderr.decode()
    assert f"SHA-256 of the {len(data)} bytes received is {sha}, expected {wrong}" in err
    assert "FNV-1a of" not in err


def test_receive_failure_keeps_existing_entry(seed_bin, cache, payload):
    data, fnv, sha = payload
    (cache / fnv).write_bytes(data)
    r = receive(seed_bin, cache, data[:-1] + b"\0", len(data), fnv, sha)
    assert r.returncode == 1
    assert sorted(p.name for p in cache.iterdir()) == [fnv]
    assert (cache / fnv).read_bytes() == data


BAD_ARGUMENTS = {
    "size-negative": lambda a: a | {"size": "-1"},
    "size-not-a-number": lambda a: a | {"size": "12x"},
    "size-empty": lambda a: a | {"size": ""},
    "fnv-uppercase": lambda a: a | {"fnv": a["fnv"].upper()},
    "fnv-15": lambda a: a | {"fnv": a["fnv"][:15]},
    "fnv-17": lambda a: a | {"fnv": a["fnv"] + "0"},
    "fnv-not-hex": lambda a: a | {"fnv": "g" + a["fnv"][1:]},
    "sha-uppercase": lambda a: a | {"sha": a["sha"].upper()},
    "sha-63": lambda a: a | {"sha": a["sha"][:63]},
    "sha-65": lambda a: a | {"sha": a["sha"] + "0"},
    "dir-missing": lambda a: a | {"dir": a["dir"].parent / "missing"},
    "dir-is-a-file": lambda a: a | {"dir": a["dir"].parent / "file"},
}


@pytest.mark.parametrize("name", BAD_ARGUMENTS)
def test_receive_bad_arguments(seed_bin, cache, payload, name):
    data, fnv, sha = payload
    (cache.parent / "file").write_bytes(b"")
    good = {"dir": cache, "size": str(len(data)), "fnv": fnv, "sha": sha}
    a = BAD_ARGUMENTS[name](good)
    assert a != good
    r = receive(seed_bin, a["dir"], data, a["size"], a["fnv"], a["sha"])
    assert r.returncode == 2
    assert b"usage:" in r.stderr
    assert list(cache.iterdir()) == []


def test_receive_wrong_argument_count(seed_bin, cache, payload):
    data, fnv, _ = payload
    r = subprocess.run([str(seed_bin), "--receive", str(cache), str(len(data)), fnv],
                       input=data, capture_output=True)
    assert r.returncode == 2 and b"usage:" in r.stderr
    assert list(cache.iterdir()) == []
