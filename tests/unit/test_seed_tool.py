"""md-rpc-seed --digest and --receive, compiled and run here: SHA-256 and FNV-1a against Python
references, and --receive putting an entry in place only for the exact bytes announced; the
cache dir's owner (rpc-server's user) planting symbolic links, malformed tensor lists, and a
GGUF that changes while it is read."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import time
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
    """md-rpc-seed reads the source in windows (256 KiB); a build with a 4099-byte one (not a
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


# ---- the cache dir's owner is not trusted ---------------------------------------------------------
# rpc-server's user owns the cache dir and may plant names in it; md-rpc-seed may run as root.
# Nothing it writes may land outside the dir, and no name there may be followed.

TENSOR = (1000, 5000)  # a range of `source`


def seed(tool: Path, gguf: Path, cache: Path, listing: str, *extra) -> subprocess.CompletedProcess:
    return subprocess.run([str(tool), *extra, str(gguf), str(cache)], input=listing, text=True,
                          capture_output=True)


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file outside the cache that a planted link points at."""
    path = tmp_path / "victim"
    path.write_bytes(b"precious, not to be overwritten\n")
    return path


@pytest.mark.parametrize("verify", [False, True], ids=["seed", "verify"])
def test_seed_does_not_follow_a_link_at_the_temporary_name(seed_bin, source, cache, victim,
                                                            verify):
    path, data = source
    off, size = TENSOR
    name = fnv1a(data[off:off + size])
    before = victim.read_bytes()
    (cache / f".{name}.tmp").symlink_to(victim)
    r = seed(seed_bin, path, cache, f"{off} {size}\n", *(["--verify"] if verify else []))
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{name} {size} written\n"
    assert victim.read_bytes() == before
    assert sorted(p.name for p in cache.iterdir()) == [name]  # the link is gone
    assert not (cache / name).is_symlink() and (cache / name).read_bytes() == data[off:off + size]


@pytest.mark.parametrize("verify", [False, True], ids=["seed", "verify"])
def test_seed_replaces_a_link_at_the_entry_name(seed_bin, source, cache, tmp_path, verify):
    """A link to a file of the right size (and even the right bytes, for --verify) is no entry:
    rpc-server would read whatever it points at later. It is replaced, its target untouched."""
    path, data = source
    off, size = TENSOR
    name = fnv1a(data[off:off + size])
    target = tmp_path / "elsewhere"
    target.write_bytes(data[off:off + size])
    (cache / name).symlink_to(target)
    r = seed(seed_bin, path, cache, f"{off} {size}\n", *(["--verify"] if verify else []))
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{name} {size} written\n"
    assert not (cache / name).is_symlink() and (cache / name).read_bytes() == data[off:off + size]
    assert target.read_bytes() == data[off:off + size]
    assert sorted(p.name for p in cache.iterdir()) == [name]


def test_seed_does_not_create_through_a_dangling_link(seed_bin, source, cache, tmp_path):
    path, data = source
    off, size = TENSOR
    name = fnv1a(data[off:off + size])
    planted = tmp_path / "planted-by-the-dir-owner"
    (cache / f".{name}.tmp").symlink_to(planted)
    r = seed(seed_bin, path, cache, f"{off} {size}\n")
    assert r.returncode == 0, r.stderr
    assert not planted.exists()
    assert sorted(p.name for p in cache.iterdir()) == [name]
    assert (cache / name).read_bytes() == data[off:off + size]


@pytest.mark.parametrize("good", [False, True], ids=["wrong-stream", "right-stream"])
def test_receive_does_not_follow_a_link_at_the_temporary_name(seed_bin, cache, payload, victim,
                                                              good):
    """--receive wrote the stream through the link before it checked a byte."""
    data, fnv, sha = payload
    before = victim.read_bytes()
    (cache / f".{fnv}.tmp").symlink_to(victim)
    r = receive(seed_bin, cache, data if good else data[:-1] + b"\0", len(data), fnv, sha)
    assert r.returncode == (0 if good else 1), r.stderr
    assert victim.read_bytes() == before
    assert sorted(p.name for p in cache.iterdir()) == ([fnv] if good else [])
    if good:
        assert not (cache / fnv).is_symlink() and (cache / fnv).read_bytes() == data


def test_receive_does_not_create_through_a_dangling_link(seed_bin, cache, payload, tmp_path):
    data, fnv, sha = payload
    planted = tmp_path / "planted-by-the-dir-owner"
    (cache / f".{fnv}.tmp").symlink_to(planted)
    r = receive(seed_bin, cache, data[:-1] + b"\0", len(data), fnv, sha)
    assert r.returncode == 1
    assert not planted.exists()
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("slash", ["", "/"], ids=["link", "link-slash"])
def test_symlinked_cache_dir_is_refused(seed_bin, source, payload, cache, tmp_path, slash):
    path, _ = source
    link = tmp_path / "cache-link"
    link.symlink_to(cache)
    off, size = TENSOR
    r = subprocess.run([str(seed_bin), str(path), str(link) + slash], input=f"{off} {size}\n",
                       text=True, capture_output=True)
    assert r.returncode == 1 and r.stdout == ""
    assert f"cache directory {link}{slash} is a symbolic link" in r.stderr
    data, fnv, sha = payload
    r = receive(seed_bin, Path(str(link) + slash), data, len(data), fnv, sha)
    assert r.returncode == 2 and b"not a symbolic link" in r.stderr
    assert list(cache.iterdir()) == []


def test_entries_are_readable_by_others(seed_bin, source, payload, cache):
    """Where md-rpc-seed still runs as root (no systemd) rpc-server may run as another user
    (launchd: nobody); rpc-server cannot tell an unreadable entry from a readable one (it checks
    only that the name exists), so entries stay 0644 less the umask."""
    path, data = source
    off, size = TENSOR
    run = dict(capture_output=True, preexec_fn=lambda: os.umask(0o022))
    r = subprocess.run([str(seed_bin), str(path), str(cache)], input=f"{off} {size}\n".encode(),
                       **run)
    assert r.returncode == 0, r.stderr
    bytes_, fnv, sha = payload
    r = subprocess.run([str(seed_bin), "--receive", str(cache), str(len(bytes_)), fnv, sha],
                       input=bytes_, **run)
    assert r.returncode == 0, r.stderr
    assert {p.stat().st_mode & 0o777 for p in cache.iterdir()} == {0o644}


# ---- malformed input -------------------------------------------------------------------------------
# The callers write exactly "<offset> <size>\n" (operations._seed_script, templates/digest.sh).

@pytest.mark.parametrize("bad", ["+1 2", "1  2", " 1 2", "1 2 ", "1\t2", "1 2\r", "1 2 \t",
                                 "1 2" + " " * 300 + "3 4", "1" * 65,
                                 "18446744073709551616 1"],
                         ids=["plus", "two-spaces", "leading-space", "trailing-space", "tab",
                              "cr", "trailing-tab", "over-long", "over-long-digits", "2^64"])
@pytest.mark.parametrize("mode", ["seed", "digest"])
def test_malformed_line_is_refused_whole(seed_bin, source, cache, bad, mode):
    path, _ = source
    listing = f"1 2\n{bad}\n7 8\n"
    if mode == "seed":
        r = seed(seed_bin, path, cache, listing)
    else:
        r = digest(seed_bin, path, listing)
    assert r.returncode == 1
    assert r.stdout.count("\n") == 1  # only line 1 answered: no entry made of part of line 2
    assert 'stdin line 2: expected "<offset> <size>", got: ' in r.stderr


def test_over_long_line_is_shown_cut(seed_bin, source):
    path, _ = source
    r = digest(seed_bin, path, "1 2" + " " * 300 + "3 4\n")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.endswith("1 2" + " " * 61 + "... (longer than 64 characters)\n")


@pytest.mark.parametrize("arg", [" -1", " 5", "+5", "5 ", "18446744073709551616"])
def test_number_arguments_are_digits_only(seed_bin, source, cache, payload, arg):
    """strtoull took " -1" for 2^64-1 (and skips spaces, takes '+')."""
    path, _ = source
    r = subprocess.run([str(seed_bin), "--hash", str(path), arg, "1"], capture_output=True,
                       text=True)
    assert r.returncode == 1 and r.stdout == ""
    assert "OFFSET and SIZE must be non-negative integers" in r.stderr
    data, fnv, sha = payload
    r = receive(seed_bin, cache, data, arg, fnv, sha)  # type: ignore[arg-type]
    assert r.returncode == 2 and b"SIZE must be a non-negative integer" in r.stderr
    assert list(cache.iterdir()) == []


# ---- a GGUF that changes while it is read ----------------------------------------------------------
# md-rpc-seed answers each line before it reads the next: the test changes the file between two
# lines, after the tool took its size, with no timing involved.

def start(tool: Path, mode: str, gguf: Path, cache: Path) -> subprocess.Popen:
    argv = [str(tool), "--digest", str(gguf)] if mode == "digest" else \
        [str(tool), str(gguf), str(cache)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def first_answer_then(p: subprocess.Popen, change, second: str) -> tuple[str, str]:
    p.stdin.write("0 4096\n")
    p.stdin.flush()
    first = p.stdout.readline()
    assert first, p.stderr.read()
    change()
    p.stdin.write(second)
    p.stdin.close()
    out = p.stdout.read()
    err = p.stderr.read()
    p.wait(timeout=60)
    return first + out, err


@pytest.mark.parametrize("mode", ["seed", "digest"])
def test_gguf_truncated_while_read(seed_bin, tmp_path, cache, mode):
    """It used to die of SIGBUS (reading a mapping past the new end)."""
    gguf = tmp_path / "shrinks.gguf"
    gguf.write_bytes(random.Random(3).randbytes(4 * MiB))
    p = start(seed_bin, mode, gguf, cache)
    out, err = first_answer_then(p, lambda: os.truncate(gguf, 8192), f"{2 * MiB} 65536\n")
    assert p.returncode == 1, (p.returncode, err)
    assert out.count("\n") == 1
    assert f"{gguf} changed while it was read: it ends before byte {2 * MiB + 65536} now " \
           f"({4 * MiB} bytes when opened)" in err
    if mode == "seed":
        assert [f.name for f in cache.iterdir()] == [out.split()[0]]  # no temporary left


@pytest.mark.parametrize("mode", ["seed", "digest"])
def test_gguf_rewritten_while_read(seed_bin, tmp_path, cache, mode):
    """Same size, new bytes, a new modification time: the next answer is not given (the callers
    count answers). The time is set apart explicitly: a write can land in the same clock tick."""
    gguf = tmp_path / "rewritten.gguf"
    gguf.write_bytes(random.Random(4).randbytes(MiB))

    def rewrite():
        st = gguf.stat()
        gguf.write_bytes(random.Random(5).randbytes(MiB))
        os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 5 * 10**9))

    p = start(seed_bin, mode, gguf, cache)
    out, err = first_answer_then(p, rewrite, "8192 4096\n")
    assert p.returncode == 1, (p.returncode, err)
    assert out.count("\n") == 1
    assert f"{gguf} changed while it was read (its size or modification time differ" in err


def test_hash_of_a_file_truncated_while_read(seed_bin, tmp_path):
    """--hash takes no list to pace it: a sparse 8 GiB file takes seconds to hash, and is cut
    short once the tool has it open (seen in /proc where there is one)."""
    big = tmp_path / "sparse.gguf"
    with big.open("wb") as f:
        f.truncate(8 << 30)
    p = subprocess.Popen([str(seed_bin), "--hash", str(big), "0", str(8 << 30)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fds, proc = Path(f"/proc/{p.pid}/fd"), Path("/proc/self/fd").is_dir()
    deadline = time.monotonic() + 30
    while proc and time.monotonic() < deadline:
        try:
            if any(os.readlink(fd) == str(big) for fd in fds.iterdir()):
                break
        except OSError:
            pass
        time.sleep(0.01)
    time.sleep(0.3 if proc else 1.0)  # past its fstat, well before the end
    os.truncate(big, 4096)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, (p.returncode, err)
    assert out == "" and f"{big} changed while it was read" in err
