"""Seeding speed of a worker that fetches its tensors: 1 lane vs more, in one run, on loopback.

Usage (no root needed; ~1 minute, 2 x --gib of disk under /tmp):
    .venv/bin/python benchmarks/fetch_lanes.py [--gib 1] [--tensor-mib 32] [--lanes 1,2,4]

Writes a file of --gib GiB cut into --tensor-mib MiB "tensors", serves it with md-share on
127.0.0.1, makes its digest list with md-rpc-seed --digest, then runs the very script
rpc_cache.seed renders for a fetching worker (curl ranges into md-rpc-seed --receive: FNV-1a and
sha256 checked before each entry is renamed) once per lane count, into a fresh cache dir. Prints
GB/s per lane count, the ratio to one lane, and md-rpc-seed's own hashing speeds for scale
(--hash: FNV only; --digest: FNV + sha256). The page cache is warm: this measures the CPU
side, not the disk or the network.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshdeploy.core.share import SERVER
from meshdeploy.roles.rpc_cache import operations as ops

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import build_seed_tool  # noqa: E402

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensor-mib", type=int, default=32)
    ap.add_argument("--lanes", default="1,2,4")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meshdeploy-lanes-"))
    server = None
    try:
        tool = build_seed_tool(work / "md-rpc-seed")
        size = int(args.gib * 1024) * MiB
        blob = work / "model.gguf"
        with open(blob, "wb") as f:
            for _ in range(size // (64 * MiB)):
                f.write(os.urandom(64 * MiB))
        step = args.tensor_mib * MiB
        ranges = [(off, step) for off in range(0, size - step + 1, step)]
        listing = "".join(f"{o} {s}\n" for o, s in ranges)
        t = time.monotonic()
        out = subprocess.run([str(tool), "--digest", str(blob)], input=listing, text=True,
                             capture_output=True, check=True).stdout
        digest_s = time.monotonic() - t
        lines = [(int(o), int(s), f, h) for o, s, f, h in (x.split() for x in out.splitlines())]
        t = time.monotonic()
        subprocess.run([str(tool), "--hash", str(blob), "0", str(size)], check=True,
                       capture_output=True)
        hash_s = time.monotonic() - t
        port = free_port()
        pid = work / "share.pid"
        server = subprocess.Popen([sys.executable, str(SERVER), "--bind", "127.0.0.1", "--port",
                                   str(port), "--allow", "127.0.0.1", "--file", f"m={blob}",
                                   "--idle", "120", "--max", "600", "--pid-file", str(pid)],
                                  stderr=subprocess.DEVNULL)
        while not pid.exists():
            time.sleep(0.05)
        model = ops.SeedModel("", "a" * 64, (), "m", "source")
        url = f"http://127.0.0.1:{port}/models/m"
        print(f"{size / 1e9:.2f} GB in {len(ranges)} tensors of {args.tensor_mib} MiB, "
              f"{os.cpu_count()} cores")
        print(f"md-rpc-seed --hash (FNV-1a): {size / hash_s / 1e9:.2f} GB/s; "
              f"--digest (FNV-1a + sha256): {size / digest_s / 1e9:.2f} GB/s (one thread)")
        base = None
        for lanes in [int(x) for x in args.lanes.split(",")]:
            cache = work / f"cache-{lanes}"
            script = ops._seed_script(str(tool), str(cache), [], [], [(model, url, lines)])
            script = script.replace(f"LANES={ops.d.rpc_cache_fetch_lanes}\n", f"LANES={lanes}\n", 1)
            t = time.monotonic()
            done = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
            seconds = time.monotonic() - t
            if done.returncode != 0:
                sys.exit(f"lanes={lanes}: the fetch failed: {done.stderr[-2000:]}")
            rate = size / seconds / 1e9
            base = base or rate
            print(f"lanes={lanes}: {seconds:.2f} s, {rate:.2f} GB/s ({rate / base:.2f}x one lane)")
            shutil.rmtree(cache)
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
