"""CUDA on a real NVIDIA GPU: the builds meshdeploy renders for a `backend: cuda` worker and a
CPU orchestrator, compiled and run on a machine with a GPU but no SSH and no internet, then what
llama.cpp allocated there against the plan's placement table, and the speed per layer.

    .venv/bin/python benchmarks/cuda_gpu.py prepare DIR --sdist llama_cpp_python-0.3.36.tar.gz
            [--arch 90] [--worker cpu]
    bash benchmarks/cuda_gpu.sh DIR OUT          # on the GPU machine, from the repository's root
    .venv/bin/python benchmarks/cuda_gpu.py compare OUT/gpu-run.tar.gz

`prepare` writes DIR/cluster.yaml (host `orch`, a CPU llama-server; host `gpu`, a cuda
rpc-server on CUDA0), the two build scripts meshdeploy renders for them (llama_cpp's build.sh,
as apply runs it), the llama.cpp tree of the sdist (without its models, docs and media: the
GPU machine's upload is small) with the commit `commit.sh` makes of it everywhere, the gguf
wheel and the fact commands the plan's probe runs (DeviceMemory, CudaCompute). `--worker cpu`
makes the worker a CPU one, to try the whole run on a machine without a GPU.

`compare` reads what came back: the facts, as the probe's parsers read them; the plan's
placement for the same model and context against llama.cpp's buffer lines; tokens per second
at each -ngl and the seconds per layer they imply (CPU layers on the orchestrator, GPU layers
through RPC). Figures go to docs/gpu.md; nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support.synthetic import Shape, write_llama  # noqa: E402

PREFIX = "/opt/meshdeploy"
PORT = 50052
CTX = 4096
# 12 layers of 354 MB (F16, n_embd 4096): 4.2 GB, big enough that a layer's time shows through
# the RPC round trips, small enough to write in seconds.
SHAPE = Shape(n_layers=12, n_embd=4096, n_ff=11008, n_head=32, n_head_kv=8, context=CTX)
# -ngl 99: every layer and the output on the worker, as meshdeploy's units run it.
NGLS = (99, 6, 0)
# Left out of the tree the GPU machine receives (its upload is small); scripts/ stays: the
# build reads scripts/ui-assets.cmake.
TRIMMED = ("models", "docs", "media", "benches", "gguf-py", ".github", "conversion", "pocs")
# One commit of the tree, the same id wherever git runs it (fixed author, committer and dates).
COMMIT_SH = """commit_tree() {
  ( cd "$1" && export GIT_AUTHOR_NAME=meshdeploy GIT_AUTHOR_EMAIL=gpu@meshdeploy.invalid \\
      GIT_COMMITTER_NAME=meshdeploy GIT_COMMITTER_EMAIL=gpu@meshdeploy.invalid \\
      GIT_AUTHOR_DATE=2026-01-01T00:00:00Z GIT_COMMITTER_DATE=2026-01-01T00:00:00Z &&
    rm -rf .git && git init -q -b master && git add -A -f &&
    git -c core.autocrlf=false -c commit.gpgsign=false commit -q -m "llama.cpp tree" )
}
"""


def cluster_text(arch: str, worker: str) -> str:
    device = "CUDA0" if worker == "cuda" else "CPU"
    return f"""\
# The GPU check's cluster (benchmarks/cuda_gpu.py): a CPU orchestrator, a CUDA worker.
cluster: gpu-check
llama_cpp:
  ref: b11312
  build:
    cuda_architectures: [{arch}]
network:
  rpc_bind: address
hosts:
  orch:
    address: 10.0.0.1
    ssh: {{user: deploy}}
    backend: cpu
  gpu:
    address: 10.0.0.2
    ssh: {{user: deploy}}
    backend: {worker}
    rpc_servers:
      - {{port: {PORT}, device: {device}}}
models:
  synthetic:
    huggingface:
      repo: meshdeploy/synthetic-GGUF
      file: synthetic.gguf
servers:
  main:
    host: orch
    model: synthetic
    port: 8080
    bind: 127.0.0.1
    ctx_size: {CTX}
"""


def trimmed_tree(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/")
            if parts[1:3] != ["vendor", "llama.cpp"] or len(parts) < 4 or parts[3] in TRIMMED:
                continue
            m = m.replace(name="/".join(parts[3:]))
            members.append(m)
        tar.extractall(dest, members=members, filter="tar")


def render_builds(cluster, commit: str) -> dict[str, tuple[str, str]]:
    """host -> (build key, the build script meshdeploy renders for it)."""
    from support.resolved import run_values
    from support.steps import decided

    from meshdeploy.core.context import HostContext
    from meshdeploy.roles.llama_cpp import operations as llama_cpp

    resolved = run_values(commit=commit, build_number=11312, models={})
    out = {}
    for host in cluster.hosts:
        key = llama_cpp.build_key(cluster, host, commit)
        facts = {"toolchain.Platform": {"kernel": "Linux", "tools": [], "termux": False},
                 "llama_cpp.Builds": {"current": None, "builds": {}}, "services.Units": {}}
        ctx = decided(HostContext(cluster, host, facts, resolved), build_key=key)
        out[host.name] = (key, llama_cpp.build_script(ctx, key))
    return out


def prepare(args) -> int:
    from meshdeploy.core.loading import load_cluster
    from meshdeploy.roles.llama_cpp.facts import CudaCompute
    from meshdeploy.roles.rpc_cache.facts import DeviceMemory

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.yaml").write_text(cluster_text(args.arch, args.worker))
    cluster = load_cluster(out / "cluster.yaml")
    work = Path(tempfile.mkdtemp(prefix="md-gpu-src-"))
    try:
        trimmed_tree(Path(args.sdist), work)
        subprocess.run(["tar", "-cJf", str(out / "llama.cpp.tar.xz"), "-C", str(work), "."],
                       check=True)
        (out / "commit.sh").write_text(COMMIT_SH)
        subprocess.run(["bash", "-c", f'. "{out}/commit.sh"; commit_tree "{work}"'], check=True)
        commit = subprocess.run(["git", "-C", str(work), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
    finally:
        shutil.rmtree(work)
    builds = render_builds(cluster, commit)
    for host, (key, script) in builds.items():
        (out / f"build-{host}.sh").write_text(script)
    if builds["gpu"][0] == builds["orch"][0]:
        # --worker cpu: one build key for both hosts, so one build of both targets (as apply
        # would build a host that runs both), not two builds racing in one tree.
        (out / "build-orch.sh").write_text(builds["orch"][1].replace("\nWANT_RPC=0\n",
                                                                     "\nWANT_RPC=1\n", 1))
        (out / "build-gpu.sh").write_text("echo 'the orchestrator builds the worker too'\n")
    (out / "fact-DeviceMemory.sh").write_text(DeviceMemory().command() + "\n")
    (out / "fact-CudaCompute.sh").write_text(CudaCompute().command() + "\n")
    shape = {k: getattr(SHAPE, k) for k in SHAPE.__dataclass_fields__}
    settings = {"PREFIX": PREFIX, "COMMIT": commit, "NGLS": " ".join(map(str, NGLS)),
                "MODEL_SHAPE": json.dumps(shape), "PORT": str(PORT), "CTX": str(CTX),
                "WORKER_DEVICE": "CUDA0" if args.worker == "cuda" else "CPU",
                "GPU_OUT": f"{PREFIX}/builds/{builds['gpu'][0]}",
                "ORCH_OUT": f"{PREFIX}/builds/{builds['orch'][0]}"}
    (out / "settings.sh").write_text("".join(f"{k}={shlex.quote(v)}\n"
                                             for k, v in settings.items()))
    from importlib.metadata import version
    if not list(out.glob("gguf-*.whl")):
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "-d", str(out), f"gguf=={version('gguf')}"],
                       check=True)
    for host, (key, script) in builds.items():
        flags = next(line for line in script.splitlines() if line.startswith("set -- "))
        print(f"{host}: {key}\n  {flags}")
    print(f"commit {commit}; {sum(f.stat().st_size for f in out.iterdir()) >> 20} MiB in {out}")
    return 0


# --- compare -------------------------------------------------------------------------------

_BUF = re.compile(r"(?P<what>\w+): +(?P<dev>\S+) (?P<kind>model|KV|compute|output) buffer size "
                  r"= +(?P<mib>[0-9.]+) MiB")


def buffers(log: str) -> list[tuple[str, str, str, float]]:
    return [(m["what"], m["dev"], m["kind"], float(m["mib"])) for m in _BUF.finditer(log)]


def compare(args) -> int:
    from tabulate import tabulate

    from meshdeploy.core.loading import load_cluster
    from meshdeploy.placement import layout
    from meshdeploy.placement.tensors import model_shape, weight_tensors
    from meshdeploy.roles.llama_cpp.facts import CudaCompute
    from meshdeploy.roles.rpc_cache.facts import DeviceMemory

    work = Path(tempfile.mkdtemp(prefix="md-gpu-cmp-"))
    with tarfile.open(args.result) as tar:
        tar.extractall(work, filter="data")
    w = work / "work"
    read = (lambda name: (w / name).read_text(errors="replace") if (w / name).exists() else "")
    print(read("nvidia-smi-query.csv"))
    memory = DeviceMemory().process(read("fact-DeviceMemory.txt").splitlines())
    caps = CudaCompute().process(read("fact-CudaCompute.txt").splitlines())
    print(f"DeviceMemory fact: {json.dumps(memory.get('cuda') if memory else None)}")
    print(f"CudaCompute fact: {caps}")
    for name in ("build-gpu.log", "build-orch.log"):
        print(f"{name}: {read(name).strip().splitlines()[-1:]}")
    settings = dict(re.findall(r"^(\w+)=(.*)$", read("settings.sh"), re.M))
    shape = Shape(**json.loads(shlex.split(settings["MODEL_SHAPE"])[0]))
    model = Path(args.model) if args.model else work / "synthetic.gguf"
    if not model.exists():
        write_llama(model, shape)
    cluster = load_cluster(work / "work" / "cluster.yaml")
    server = next(s for s in cluster.servers if s.name == "main")
    lay = layout.build(cluster, server, weight_tensors(model), model_shape(model),
                       {"gpu": memory})
    mib = 1 << 20
    rows = [[r["device"], r["layers"], r["weights"] / mib, r["kv"] / mib,
             (r["free"] or 0) / mib] for r in lay.rows]
    print("\nThe plan's placement (MiB):")
    print(tabulate(rows, ["device", "layers", "weights", "KV", "free"], floatfmt=".2f"))
    for ngl in shlex.split(settings["NGLS"])[0].split():
        log = read(f"server-ngl{ngl}.log")
        print(f"\nllama-server -ngl {ngl}: llama.cpp's buffers (MiB)")
        print(tabulate(buffers(log), ["", "device", "buffer", "MiB"], floatfmt=".2f"))
        used = read(f"gpu-used-ngl{ngl}.txt").strip()
        if used:
            print(f"nvidia-smi while loaded: used, free (MiB) = {used}")
        runs = [json.loads(line) for line in read(f"timings-ngl{ngl}.jsonl").splitlines()
                if line.startswith("{")][1:]   # the first completion warms up
        if runs:
            gen = sorted(r["predicted_per_second"] for r in runs)[len(runs) // 2]
            pp = sorted(r["prompt_per_second"] for r in runs)[len(runs) // 2]
            print(f"generation {gen:.2f} tok/s ({1000 / gen:.3f} ms/token), "
                  f"prompt {pp:.1f} tok/s (median of {len(runs)})")
    rpc = read("rpc-server.log")
    print("\nrpc-server:\n" + "\n".join(rpc.splitlines()[:12]))
    print(f"\n(unpacked in {work})")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dir")
    p.add_argument("--sdist", required=True, help="llama-cpp-python sdist (its vendor/llama.cpp)")
    p.add_argument("--arch", default="90", help="cuda_architectures (default 90: H100/H200)")
    p.add_argument("--worker", choices=("cuda", "cpu"), default="cuda")
    c = sub.add_parser("compare")
    c.add_argument("result", help="gpu-run.tar.gz from cuda_gpu.sh")
    c.add_argument("--model", help="the synthetic model, if already written here")
    args = parser.parse_args()
    return prepare(args) if args.verb == "prepare" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
