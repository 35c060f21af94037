"""Soak `meshdeploy validate` with mutated and generated cluster files; print the figures.

    .venv/bin/python benchmarks/fuzz_validate.py [--docs 10000] [--seed 0] [--keep DIR]

Documents come from tests/support/validate_fuzz.py (the example inventories mutated: values, keys,
control characters, bytes that are not UTF-8, duplicate keys, aliases and alias bombs, deep
nesting, odd tags, %YAML directives, huge lists; plus documents generated around the schema's
keys), each reproducible from its seed. Each is validated in-process through load_cluster (the
code `meshdeploy validate` runs, without the interpreter's start-up), under a 10 s alarm.

The figures, each with its goal: internal errors (any exception but ConfigError) 0, hangs
(past 10 s) 0, runs over 2 s 0, errors without a location (or not one clean line) 0. --keep
saves every document that broke a promise, named by seed, to replay with `meshdeploy validate`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.validate_fuzz import Hang, check, document, hang_guard  # noqa: E402

SLOW = 2.0
HANG = 10


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0, help="first document's seed")
    parser.add_argument("--keep", type=Path, help="save documents that broke a promise here")
    args = parser.parse_args()

    times: list[tuple[float, int]] = []
    valid = internal = hangs = slow = unlocated = 0
    broken: list[tuple[int, str]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cluster.yaml"
        for seed in range(args.seed, args.seed + args.docs):
            path.write_bytes(document(seed))
            began = time.perf_counter()
            try:
                with hang_guard(HANG):
                    outcome = check(path)
            except Hang:
                hangs += 1
                broken.append((seed, "hang"))
                times.append((HANG, seed))
                continue
            except Exception:  # noqa: BLE001 - counting these is the point
                internal += 1
                broken.append((seed, traceback.format_exc(limit=-3)))
                times.append((time.perf_counter() - began, seed))
                continue
            times.append((outcome.seconds, seed))
            valid += outcome.valid
            slow += outcome.seconds > SLOW
            if outcome.problems:
                unlocated += 1
                broken.append((seed, "\n".join(outcome.problems)))
    total = time.monotonic() - started

    if args.keep and broken:
        args.keep.mkdir(parents=True, exist_ok=True)
        for seed, _ in broken:
            (args.keep / f"seed-{seed}.yaml").write_bytes(document(seed))
    for seed, what in broken[:20]:
        print(f"seed {seed}: {what.strip()}", file=sys.stderr)

    seconds = sorted(t for t, _ in times)
    slowest, slowest_seed = max(times)
    print(f"documents tried:                 {args.docs:,} (seeds {args.seed}.."
          f"{args.seed + args.docs - 1})")
    print(f"  valid / refused:               {valid:,} / {args.docs - valid:,}")
    print(f"internal errors / tracebacks:    {internal} (goal 0)")
    print(f"hangs (> {HANG} s):                  {hangs} (goal 0)")
    print(f"runs over {SLOW:g} s:                  {slow} (goal 0)")
    print(f"errors without a location:       {unlocated} (goal 0)")
    print(f"time per document: median {statistics.median(seconds) * 1000:.1f} ms, "
          f"p99 {seconds[int(len(seconds) * 0.99) - 1] * 1000:.1f} ms, "
          f"slowest {slowest:.3f} s (seed {slowest_seed})")
    print(f"total: {total:.0f} s")
    return 1 if internal or hangs or unlocated else 0


if __name__ == "__main__":
    sys.exit(main())
