"""pytest imports test modules by their basename (rootdir-relative "prepend" import mode): two
test files with one name, e.g. tests/test_x.py and tests/lab/test_x.py, stop collection of the
whole suite with "import file mismatch" on a clean checkout. Lab tests end in `_lab.py` where a
unit test of the same subject exists."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_name():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []
