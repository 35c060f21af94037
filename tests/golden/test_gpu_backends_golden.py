"""What each GPU backend's host gets (tests/data/gpu-backends.yaml): its packages per package
manager, the cmake switches of its build and the GPU code it compiles for.

None of these GPUs is here: the goldens pin what meshdeploy would run. Facts are as such hosts
report them: Debian trixie with non-free enabled (CUDA), AMD's ROCm 6.2 (the pinned tree needs
6.1; Debian's 5.7 is refused by the preflight, tests/fixture/operations/llama_cpp.preflight).
MESHDEPLOY_UPDATE_GOLDEN=1 rewrites them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from support import golden
from support.steps import decided
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.core.context import HostContext
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.toolchain import operations as toolchain
from meshdeploy.roles.llama_cpp import settings

TESTS = Path(__file__).resolve().parents[1]
GOLDEN = TESTS / "golden" / "gpu"
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
TOOLS = ["apt-get", "cc", "c++", "cmake", "curl", "git", "ninja", "sha256sum", "systemctl"]
DEVICE_FACTS = {"cuda": {"llama_cpp.CudaCompute": ["86"]},
                "rocm": {"llama_cpp.Hip": {"version": [6, 2], "candidate": None,
                                           "targets": ["gfx1030"]}}}


def facts_of(host, manager="apt", termux=False):
    tools = {"apt": TOOLS, "dnf": [t if t != "apt-get" else "dnf" for t in TOOLS],
             "pkg": ["pkg", "cmake", "c++", "git", "curl", "ninja", "getconf", "flock",
                     "setsid"]}[manager]
    return {"toolchain.Platform": {"kernel": "Linux", "machine": "x86_64",
                                   "distro": "fedora" if manager == "dnf" else "debian",
                                   "version": "13", "tools": tools, "termux": termux,
                                   "cmake_version": (3, 31, 6)},
            "toolchain.DebPackages": {}, "toolchain.AptComponents": ["main", "contrib", "non-free"],
            "llama_cpp.Libc": "glibc 2.41", "llama_cpp.Builds": {"current": None, "builds": {}},
            **DEVICE_FACTS.get(host.backend, {})}


def render(cluster) -> str:
    out = [f"# gpu-backends.yaml: llama.cpp {COMMIT[:12]}"]
    resolved = run_values(commit=COMMIT, build_number=11312)
    for host in cluster.hosts:
        ctx = HostContext(cluster, host, facts_of(host), resolved)
        llama_cpp.preflight(ctx)
        toolchain.preflight(ctx)
        key = llama_cpp.build_key(cluster, host, COMMIT, facts=ctx.facts)
        decided(ctx, build_key=key)
        out.append(f"\n## {host.name} ({host.backend}) apt")
        out += toolchain.packages(ctx).commands
        script = llama_cpp.build_script(ctx, key)
        out.append(f"## {host.name} ({host.backend}) build {key}")
        out += [line for line in script.splitlines()
                if line.startswith("set -- ")
                or host.backend == "rocm" and line.startswith('if [ "$BACKEND" = rocm ]')]
    vk = cluster.host("vk")
    for manager, termux in (("dnf", False), ("pkg", True)):
        host = replace(vk, rootless=termux)
        ctx = HostContext(cluster, host, facts_of(host, manager, termux), resolved)
        out.append(f"\n## vk (vulkan) {manager}")
        out += toolchain.packages(ctx).commands
    return "\n".join(out) + "\n"


def test_gpu_hosts_get_their_packages_switches_and_gpu_code_golden():
    cluster = load_cluster(TESTS / "data" / "gpu-backends.yaml")
    golden.check(GOLDEN / "gpu-backends.txt", render(cluster))


def test_a_cuda_host_without_a_driver_compiles_for_the_files_architectures():
    cluster = load_cluster(TESTS / "data" / "gpu-backends.yaml")
    cluster = settings.with_build(cluster, cuda_architectures=("86", "89"))
    host = cluster.host("cu")
    facts = facts_of(host)
    del facts["llama_cpp.CudaCompute"]
    facts["toolchain.Platform"]["tools"] = TOOLS + ["nvcc"]  # no nvidia-smi
    ctx = HostContext(cluster, host, facts, run_values(commit=COMMIT, build_number=11312))
    toolchain.preflight(ctx)
    llama_cpp.preflight(ctx)
    assert "-DCMAKE_CUDA_ARCHITECTURES=86;89" in llama_cpp.cmake_flags(cluster, host, facts=facts)
    # nvcc on PATH (NVIDIA's own toolkit) stands for Debian's: not installed beside it.
    assert "nvidia-cuda-toolkit" not in " ".join(toolchain.packages(ctx).commands)
