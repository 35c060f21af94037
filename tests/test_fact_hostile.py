"""A fact parser never raises on host data (issue 20).

Every fact's process() reads what a host printed, and some of it comes from files that a
compromised service can write (the rpc-server cache marker, digest lists). One line that
process() cannot take must not end the operator's plan: it is skipped, and where the file
matters the fact says which line it skipped. Here every registered fact class gets its fixture
outputs (tests/facts/) with each word swapped for a hostile one, each line cut short, and
hostile lines of its own: Unicode digits that str.isdigit() takes and int() refuses or misreads,
digit strings past int()'s 4300-digit limit, control characters, NUL, lone surrogates, deep JSON.
The CacheDir command itself is run against a real folder a service user could have prepared.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_fixtures import FACT_DIR, fact_classes

from meshdeploy.core import probe
from meshdeploy.roles.rpc_cache import defaults as d
from meshdeploy.roles.rpc_cache.facts import CacheDir, Digests

WORDS = ["³", "١٢٣", "１２", "9" * 5000, "1_000", " 7", "-1", "0x1f", "1e999", "nan", "",
         "\x00", "\x1b[2J", "\r", "\udcff", "a" * 100_000]
LINES = ["", " ", "\x00", "³", "@@unit ", "@@unit", "== ", "cmake version", "cmake version ³.1",
         "[" * 100_000, '{"nftables": ' + "[" * 100_000, "{" * 5000, "9" * 5000]
JSON_VALUES = ["³", 10 ** 30, -1, 1.5, float("inf"), None, True, [], {}, [[[]]], "x" * 1000]


def _fixture_outputs(key: str) -> list[list[str]]:
    return [json.loads(p.read_text())["output"] for p in sorted((FACT_DIR / key).glob("*.json"))]


def _json_leaves(value, path=()):
    """Paths to every value inside a JSON document."""
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _json_leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _json_leaves(v, (*path, i))


def _replaced(doc, path, new):
    if not path:
        return new
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[path[0]] = _replaced(doc[path[0]], path[1:], new)
    return copy


def _json_mutations(line: str):
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        return
    for path in _json_leaves(doc):
        for value in JSON_VALUES:
            yield json.dumps(_replaced(doc, path, value))


def mutations(output: list[str]):
    """Hostile versions of one output: partial, words swapped, lines cut, lines added."""
    for i in range(len(output) + 1):
        yield output[:i]
    for i, line in enumerate(output):
        words = line.split(" ")
        for j in range(len(words)):
            yield [*output[:i], " ".join(words[:j]), *output[i + 1:]]
            for word in WORDS:
                yield [*output[:i], " ".join([*words[:j], word, *words[j + 1:]]), *output[i + 1:]]
        yield [*output[:i], line[:len(line) // 2], *output[i + 1:]]
        for hostile in LINES:
            yield [*output[:i + 1], hostile, *output[i + 1:]]
        for changed in _json_mutations(line):
            yield [*output[:i], changed, *output[i + 1:]]


def all_facts() -> dict:
    """Every role's fact classes (found through the registry) and the probe's own."""
    return {**fact_classes(), "probe.SudoCheck": probe.SudoCheck,
            "probe.DiskFree": probe.DiskFree, "probe.Stored": probe.Stored}


@pytest.mark.parametrize("key", sorted(all_facts()))
def test_process_never_raises_on_hostile_output(key):
    fact = all_facts()[key]()
    outputs = _fixture_outputs(key) + [[line] for line in LINES] + [LINES]
    failures = []
    for base in outputs:
        for output in mutations(base):
            try:
                fact.process(list(output))
            except Exception as exc:  # noqa: BLE001 - the contract is "never"
                failures.append(f"{type(exc).__name__}: {exc!s:.80} <- {ascii(output)[:160]}")
    assert not failures, f"{len(failures)} outputs raised, e.g.:\n" + "\n".join(failures[:5])


# -- rpc_cache.CacheDir, run against a folder its service user prepared --------------------------

def _cache_dir(path: Path):
    out = subprocess.run(["sh", "-c", CacheDir().command(path=str(path))], capture_output=True,
                         check=True)
    # Bytes a host prints arrive through paramiko, which decodes UTF-8 strictly.
    return CacheDir().process(out.stdout.decode("utf-8").splitlines())


def test_cache_dir_refuses_a_symlinked_folder(tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / "f42cfb619b3cade9").write_bytes(b"x")
    (real / d.rpc_cache_marker).write_text(f"{'a' * 64} 1 1 f42cfb619b3cade9\n")
    (tmp_path / "rpc").symlink_to(real)
    assert _cache_dir(tmp_path / "rpc") == {"entries": {}, "temporary": [], "marker": [],
                                            "link": True}
    (tmp_path / "gone").symlink_to(tmp_path / "nothing")
    assert _cache_dir(tmp_path / "gone")["link"] is True
    assert _cache_dir(tmp_path / "nothing") is None


def test_cache_dir_names_cannot_forge_lines(tmp_path):
    (tmp_path / "f42cfb619b3cade9").write_bytes(b"x" * 3)
    (tmp_path / "x\nfile 99 0000000000000001").write_bytes(b"y")
    (tmp_path / ".0000000000000002.tmp\nfile 98 0000000000000003").write_bytes(b"y")
    (tmp_path / ".meshdeploy-seed-list\nfile 97 0000000000000004").write_bytes(b"y")
    (tmp_path / os.fsdecode(b".meshdeploy-seed-list.\xff")).write_bytes(b"y")
    (tmp_path / "0000000000000005").mkdir()
    (tmp_path / "0000000000000006").symlink_to("/etc/hostname")
    (tmp_path / "*").write_bytes(b"glob")
    (tmp_path / "-n").write_bytes(b"option")
    value = _cache_dir(tmp_path)
    assert value == {"entries": {"f42cfb619b3cade9": 3}, "temporary": [], "marker": []}


def test_cache_dir_marker_link_and_damaged_lines_are_reported(tmp_path):
    good = f"{'a' * 64} 6527680 3 f42cfb619b3cade9"
    (tmp_path / "f42cfb619b3cade9").write_bytes(b"x" * 3)
    marker = tmp_path / d.rpc_cache_marker
    marker.write_bytes(f"{good}\n{'a' * 64} ³ 3 f42cfb619b3cade9\n".encode()
                       + b"\xff\x00\x1b" + b"9" * 5000 + b"\n")
    value = _cache_dir(tmp_path)
    assert value["marker"] == [("a" * 64, 6527680, 3, "f42cfb619b3cade9")]
    assert value["damaged"][0].startswith("line 2: 'aaaa")
    assert value["damaged"][1].startswith("line 3: '???999") and value["damaged"][1].endswith("...")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text(good + "\n")
    marker.unlink()
    marker.symlink_to(elsewhere)
    value = _cache_dir(tmp_path)
    assert value["marker"] == [] and value["damaged"] == ["the marker is a symbolic link; not read"]


def test_digests_report_damaged_lines_per_model():
    sha = "a" * 64
    good = f"line {sha} 1 2 f42cfb619b3cade9 {'b' * 64}"
    value = Digests().process(["model gemma", good, f"line {sha} ³ 2 f42cfb619b3cade9 {'b' * 64}",
                               "line", "model qwen", good])
    assert value["gemma"][sha] == [[1, 2, "f42cfb619b3cade9", "b" * 64]]
    first, second = value["gemma"]["damaged"]
    assert first.startswith(f"line 2: '{sha} \\xb3 2 f42") and first.endswith("...")
    assert first.isascii() and len(first) < 100 and second == "line 3: ''"
    assert "damaged" not in value["qwen"]
