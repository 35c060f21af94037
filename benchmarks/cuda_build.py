"""The build meshdeploy renders for a `backend: cuda` host, run to the end with Debian's own CUDA
toolkit on a lab host that has no GPU (a host that only builds for others), then what the
binaries hold: the toolkit, the GPU code compiled (cuobjdump), the CUDA libraries they link,
and what the worker says on a host with no NVIDIA driver. Not in CI: the CUDA backend's compile
takes most of an hour of 2 cores and the toolkit is a download of gigabytes (docs/lab.md).

    sudo .venv/bin/python benchmarks/cuda_build.py [--arch 90] [--keep]

Lab `mdcu`: one Debian 13 host from the plain base, `backend: cuda` with
`llama_cpp.build.cuda_architectures: [ARCH]` (no driver answers nvidia-smi there, so the file
says what to compile for). `apply -target=node1/llama_cpp.build` installs the toolchain (the
toolkit from Debian's contrib and non-free components, which the script enables as a user
would) and compiles; nothing else is started. Exits 1 when a step fails. docs/gpu.md says how
to run the result on a GPU.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support.labfile import lab_text, write_lab_file  # noqa: E402

from meshdeploy.lab import Lab  # noqa: E402

NAME = "mdcu"
PREFIX = "/opt/meshdeploy"


def cluster_text(info, arch: str) -> str:
    """inventories/lab.yaml with node1 alone, a cuda host with an rpc-server and the server."""
    text = lab_text(info)
    text = text.replace("    cmake_flags: [-DGGML_NATIVE=OFF]\n",
                        f"    cmake_flags: [-DGGML_NATIVE=OFF]\n    cuda_architectures: [{arch}]\n")
    start, end = text.index("  node2:\n"), text.index("\nmodels:\n")
    text = text[:start] + text[end + 1:]
    return text.replace("    backend: cpu\n", "    backend: cuda\n    rpc_servers:\n"
                        "      - {port: 50052, device: CUDA0}\n", 1)


def meshdeploy(*args: str) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "meshdeploy", *args], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL)
    done.seconds = time.monotonic() - started
    print(f"\n$ meshdeploy {' '.join(args)}  -> {done.returncode} in {done.seconds:.0f} s",
          flush=True)
    return done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (default 90)")
    parser.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    args = parser.parse_args()
    handle = Lab(name=NAME, hosts=1, suites={"node1": "trixie"})
    info = handle.up()
    try:
        return run(info, args.arch)
    finally:
        if not args.keep:
            handle.down()


def sh(info, command: str) -> str:
    done = info.run("node1", command, root=True, timeout=300)
    return (done.stdout + done.stderr).strip()


def run(info, arch: str) -> int:
    path = str(write_lab_file(info, Path(tempfile.mkdtemp(prefix="md-cuda-")),
                              text=cluster_text(info, arch)))
    # As a Debian user enables them (the plan refuses a cuda host whose sources lack them, and
    # says so): contrib and non-free on each deb line of sources.list.
    sh(info, "sed -i -E 's/^(deb .* main)$/\\1 contrib non-free/' /etc/apt/sources.list && "
             "cat /etc/apt/sources.list")
    target = "-target=node1/llama_cpp.build"
    plan = meshdeploy("plan", path, target)
    print("\n".join(line for line in plan.stdout.splitlines()
                    if re.search(r"packages|cmake|CUDA|cuda|will be|Plan:", line)))
    if plan.returncode not in (0, 2):
        print(plan.stdout[-4000:], plan.stderr[-3000:])
        sys.exit("cuda_build: plan failed")
    applied = meshdeploy("apply", path, target, "--auto-approve")
    for line in applied.stdout.splitlines():
        if re.search(r"\b(ok|failed) \([0-9.]+ s\)", line):
            print(line)
    if applied.returncode:
        print(applied.stdout[-6000:], applied.stderr[-3000:])
        sys.exit("cuda_build: apply failed")
    build = sh(info, f"readlink -f {PREFIX}/current || ls -d {PREFIX}/builds/*")
    print(f"\nbuild: {build}")
    print(sh(info, "nvcc --version | tail -2; dpkg-query -W nvidia-cuda-toolkit; "
                   "grep -rh '^compiler-bindir' /etc/nvcc.profile 2>/dev/null; "
                   "ls -l /usr/lib/nvidia-cuda-toolkit/bin/ 2>/dev/null | tail -3"))
    print(sh(info, f"ls -la {build}/bin | head -30"))
    for binary in ("ggml-rpc-server", "llama-server"):
        print(f"\n{binary}: linked CUDA libraries and GPU code")
        print(sh(info, f"readelf -d {build}/bin/{binary} | grep NEEDED"))
        print(sh(info, f"cuobjdump --list-elf {build}/bin/{binary} 2>&1 | "
                       "sed 's/.*\\.\\(sm_[0-9a-z]*\\)\\..*/\\1/' | sort | uniq -c"))
    print("\nggml-rpc-server on a host without an NVIDIA driver:")
    print(sh(info, f"timeout 20 {build}/bin/ggml-rpc-server --help 2>&1 | head -5"))
    print(f"\ncuda_build: built for sm_{arch} in the apply above")
    return 0


if __name__ == "__main__":
    sys.exit(main())
