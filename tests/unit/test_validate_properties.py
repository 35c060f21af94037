"""Property tests: no cluster file makes `meshdeploy validate` crash, hang or lose the location.

Documents are the example inventories mutated and documents generated around the schema's keys
(tests/support/validate_fuzz.py). For each: validate succeeds or raises ConfigError whose every issue is
at file:line:col (only an unreadable file is named alone), on one clean line; no other exception
escapes; the CLI prints no traceback and exits 0 or 3. Budgets are fixed and derandomized so CI
runs the same documents every time; speed is not asserted here (shared, noisy machines) but a
run past 10 s fails as a hang. benchmarks/fuzz_validate.py is the long soak with the figures.
"""

from __future__ import annotations

import contextlib
import io
import random
import tempfile
from pathlib import Path

import pytest
from support import validate_fuzz as fuzz
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ruamel.yaml import YAML

from meshdeploy import cli, errors
from meshdeploy.errors import ConfigError, ConfigIssue

BUDGET = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HANG_S = 10


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp) / "cluster.yaml"


def assert_validates_cleanly(path: Path, data: bytes) -> fuzz.Outcome:
    path.write_bytes(data)
    with fuzz.hang_guard(HANG_S):
        outcome = fuzz.check(path)
    assert outcome.problems == [], data[:400]
    return outcome


mutation = st.tuples(st.sampled_from(fuzz.MUTATIONS), st.integers(0, 2 ** 32 - 1))


@BUDGET
@given(seed=st.sampled_from(fuzz.SEEDS), steps=st.lists(mutation, min_size=1, max_size=4),
       junk=st.none() | st.tuples(st.integers(0, 10 ** 6), st.sampled_from(fuzz.JUNK)))
def test_mutated_inventories(scratch, seed, steps, junk):
    text = seed
    for mutate, n in steps:
        text = mutate(text, random.Random(n))
    data = text.encode("utf-8", "surrogatepass")
    if junk:
        at = junk[0] % (len(data) + 1)
        data = data[:at] + junk[1] + data[at:]
    assert_validates_cleanly(scratch, data)


@BUDGET
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_documents_of_the_soak_corpus(scratch, seed):
    assert_validates_cleanly(scratch, fuzz.document(seed))


# Structures around the real keys, written by ruamel itself: always YAML, any Unicode.
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | \
    st.sampled_from(["auto", "none", "10.0.0.1", "node1:50052", "b11312", "/opt/x", "m"])
keys = st.sampled_from(fuzz.KEYS + ["node1", "node2", "m", "s"]) | st.text(max_size=8)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                      st.dictionaries(keys, inner, max_size=5), max_leaves=30)
documents = st.fixed_dictionaries(
    {}, optional={"cluster": values, "llama_cpp": values, "hosts": values, "models": values,
                  "servers": values, "network": values, "toolchain": values,
                  "huggingface": values, "x-a": values})


@BUDGET
@given(doc=documents, flow=st.booleans())
def test_generated_documents(scratch, doc, flow):
    yaml = YAML(typ="rt")
    yaml.default_flow_style = flow
    out = io.StringIO()
    yaml.dump(doc, out)
    assert_validates_cleanly(scratch, out.getvalue().encode("utf-8", "surrogatepass"))


@settings(BUDGET, max_examples=40)
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_cli_never_prints_a_traceback(scratch, seed):
    scratch.write_bytes(fuzz.document(seed))
    err = io.StringIO()
    with fuzz.hang_guard(HANG_S), contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["validate", str(scratch)])
    text = err.getvalue()
    assert "Traceback" not in text and "internal error" not in text, text
    assert code in (errors.OK, errors.CONFIG), text
    if code == errors.CONFIG:
        assert text.startswith(f"{scratch}:"), text


def test_the_checker_catches_a_broken_promise(tmp_path):
    """The properties above can fail: an unlocated or multi-line issue is reported."""
    path = str(tmp_path / "c.yaml")
    unlocated = ConfigError([ConfigIssue(path, 0, 0, "", "YAML error: boom")])
    assert fuzz.issue_problems(path, unlocated) == [f"no line:col: {path}: YAML error: boom"]
    spilled = ConfigError([ConfigIssue(path, 3, 1, "servers.s.extra_args[0]", "'x\nExec'")])
    assert fuzz.issue_problems(path, spilled)[0].startswith("not one clean line")
    located = ConfigError([ConfigIssue(path, 0, 0, "", "cannot read: is a directory")])
    assert fuzz.issue_problems(path, located) == []


@BUDGET
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_documents_shaped_like_a_cluster_file(scratch, seed):
    """Past the schema, into the semantic checks: hosts without a backend, rpc-servers on low
    ports or DNS-named hosts, references to what the file lacks, no network section."""
    assert_validates_cleanly(scratch, fuzz.structured(random.Random(seed)))
