"""Per-device free memory: device_free's rules, the decode helpers, and the fact's shell filters
run for real against stand-in tools that print the documented output formats."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from support.require import needs, unmet

from meshdeploy.roles.rpc_cache.facts import DeviceMemory
from meshdeploy.placement.memory import (CUDA_CONTEXT, GiB, MiB, DeviceFree, device_free,
                                               metal_working_set, vulkan_devices,
                                               vulkan_every_device)

LINUX = {"cpu": {"total": 64 * GiB, "available": 50 * GiB, "source": "/proc/meminfo"},
         "cuda": [{"total": 24 * GiB, "free": 23 * GiB}, None,
                  {"total": 16 * GiB, "free": 9 * GiB}],
         "rocm": [{"total": 64 * GiB, "free": 60 * GiB}, {"total": 64 * GiB, "free": 31 * GiB}],
         "vulkan": [{"total": 24 * GiB, "free": 22 * GiB, "budget": True, "type": "discrete"}],
         "metal": None}
MAC = {"cpu": {"total": 16 * GiB, "source": "sysctl hw.memsize"}, "cuda": [], "rocm": [],
       "vulkan": [], "metal": {"total": 11453246122, "free": 11453246122, "estimated": True}}


# -- device_free -----------------------------------------------------------------------------------

def test_cpu_offers_all_memory_to_the_split_and_available_memory_to_the_headroom():
    for backend in ("cpu", "cuda", "rocm", "vulkan"):
        assert device_free(LINUX, backend, "CPU") == \
            DeviceFree(64 * GiB, 50 * GiB, "/proc/meminfo", False)


def test_cpu_without_an_available_figure_falls_back_to_total():
    assert device_free(MAC, "metal", "CPU") == DeviceFree(16 * GiB, 16 * GiB, "sysctl hw.memsize",
                                                          False)


def test_gpu_lists_by_index_and_backend():
    assert device_free(LINUX, "cuda", "CUDA0") == DeviceFree(
        23 * GiB - CUDA_CONTEXT, 23 * GiB - CUDA_CONTEXT, "nvidia-smi, less a CUDA context", False)
    assert device_free(LINUX, "cuda", "CUDA2").split == 9 * GiB - CUDA_CONTEXT
    assert device_free(LINUX, "rocm", "ROCm1") == DeviceFree(31 * GiB, 31 * GiB, "rocm-smi",
                                                             False)
    assert device_free(LINUX, "vulkan", "Vulkan0") == DeviceFree(22 * GiB, 22 * GiB,
                                                                 "vulkaninfo", False)


def test_a_cuda_device_counts_what_its_running_workers_hold_as_free_and_its_context_as_not():
    """The H200's figures (docs/gpu.md): nvidia-smi read 143,156 MiB free before the worker
    started, and the worker itself saw 142,629 MiB once its CUDA context was up. While a worker
    (or a llama-server) holds a model, nvidia-smi's free drops by what it holds; a re-plan must
    not read that as a smaller card (its restart frees it)."""
    idle = {"cuda": [{"total": 143771 * MiB, "free": 143156 * MiB, "uuid": "GPU-1",
                      "held": 0}]}
    seen_by_the_worker = 142629 * MiB
    assert abs(device_free(idle, "cuda", "CUDA0").split - seen_by_the_worker) <= 16 * MiB
    loaded = {"cuda": [{"total": 143771 * MiB, "free": 138216 * MiB, "uuid": "GPU-1",
                        "held": 4941 * MiB - 1 * MiB}]}
    assert device_free(loaded, "cuda", "CUDA0") == device_free(
        {"cuda": [{**loaded["cuda"][0], "free": 143156 * MiB, "held": 0}]}, "cuda", "CUDA0")
    # Nothing left after the context: none free, never negative.
    tiny = {"cuda": [{"total": 1 * GiB, "free": 100 * MiB}]}
    assert device_free(tiny, "cuda", "CUDA0").usable == 0


def test_metal_estimated_and_pinned():
    assert device_free(MAC, "metal", "MTL0") == DeviceFree(11453246122, 11453246122,
                                                           "sysctl (estimated)", True)
    pinned = {**MAC, "metal": {"total": 57344 * MiB, "free": 57344 * MiB, "estimated": False}}
    assert device_free(pinned, "metal", "MTL0") == DeviceFree(57344 * MiB, 57344 * MiB,
                                                              "sysctl iogpu.wired_limit_mb", False)


@pytest.mark.parametrize("mem, backend, device", [
    (None, "cuda", "CUDA0"),                      # host not probed
    ({}, "cpu", "CPU"),
    (LINUX, "cuda", "CUDA1"),                     # nvidia-smi printed [N/A] for that GPU
    (LINUX, "cuda", "CUDA3"),                     # more devices configured than reported
    (LINUX, "rocm", "ROCm2"),
    (LINUX, "vulkan", "Vulkan1"),
    (LINUX, "rocm", "CUDA0"),                     # a ROCm build has no CUDA devices
    (LINUX, "cuda", "Vulkan0"),
    (LINUX, "cuda", "MTL0"),
    (MAC, "metal", "MTL1"),                       # Metal has one device
    (LINUX, "cuda", "SYCL0"),                     # a backend meshdeploy cannot query
    (LINUX, "cuda", "CUDA"),
    (LINUX, "cuda", "CUDAx"),
    ({"cpu": None, "cuda": [{"total": GiB, "free": GiB}]}, "cuda", "CPU"),
    ({"cpu": None, "cuda": [{"total": GiB, "free": GiB}]}, "rocm", "ROCm0"),  # older shape
    ({**MAC, "metal": None}, "metal", "MTL0"),    # Intel Mac: no working set known
])
def test_unknown_is_none(mem, backend, device):
    assert device_free(mem, backend, device) is None


def test_device_free_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        device_free(LINUX, "cpu", "CPU").split = 1


# -- decode helpers --------------------------------------------------------------------------------

@pytest.mark.parametrize("memsize, limit, expected", [
    (16 * GiB, 0, (11453246122, True)),           # macOS reports 11453.25 MB
    (32 * GiB, 0, (32 * GiB * 2 // 3, True)),     # 21845.33 MiB
    (36 * GiB, 0, (24 * GiB, True)),
    (64 * GiB, 0, (48 * GiB, True)),              # 49152 MiB on macOS 13-14
    (96 * GiB, 0, (72 * GiB, True)),              # 73728 MiB
    (128 * GiB, 114688 * MiB, (112 * GiB, False)),  # reported: 112.00 GiB with that limit
    (16 * GiB, 32768 * MiB, (16 * GiB, False)),   # a limit above the memory cannot be had
    (None, 8192 * MiB, (8 * GiB, False)),
    (None, 0, None),
])
def test_metal_working_set(memsize, limit, expected):
    assert metal_working_set(memsize, limit) == expected


def gpu(kind, uuid, *heaps):
    out = [["gpu", "0"], ["type", f"PHYSICAL_DEVICE_TYPE_{kind}"], ["uuid", uuid]]
    for size, budget, usage, local in heaps:
        out.append(["heap"])
        out.append(["size", str(size)])
        if budget is not None:
            out += [["budget", str(budget)], ["usage", str(usage)]]
        if local:
            out.append(["local"])
    return out


def test_integrated_gpu_counts_every_heap():
    # An AMD APU under RADV: a 512 MiB carve-out plus GTT in system memory.
    apu = gpu("INTEGRATED_GPU", "u1", (512 * MiB, 500 * MiB, 10 * MiB, True),
              (15 * GiB, 12 * GiB, 0, False))
    assert vulkan_devices(apu) == [{"total": 512 * MiB + 15 * GiB,
                                    "free": 490 * MiB + 12 * GiB, "budget": True,
                                    "type": "integrated"}]


def test_discrete_gpu_counts_device_local_heaps_only():
    # Without resizable BAR, RADV adds a 256 MiB host-visible VRAM heap: ggml counts both.
    card = gpu("DISCRETE_GPU", "u1", (8 * GiB, None, None, True), (32 * GiB, None, None, False),
               (256 * MiB, None, None, True))
    assert vulkan_devices(card) == [{"total": 8 * GiB + 256 * MiB, "free": 8 * GiB + 256 * MiB,
                                     "budget": False, "type": "discrete"}]


def test_same_gpu_under_two_drivers_is_one_device():
    radv = gpu("DISCRETE_GPU", "same", (24 * GiB, 23 * GiB, 0, True))
    amdvlk = gpu("DISCRETE_GPU", "same", (24 * GiB, 22 * GiB, 0, True))
    other = gpu("DISCRETE_GPU", "other", (8 * GiB, 7 * GiB, 0, True))
    devices = vulkan_devices(radv + amdvlk + other)
    assert [d["free"] for d in devices] == [23 * GiB, 7 * GiB]


def test_cpu_devices_are_skipped_and_virtual_ones_only_stand_in():
    llvmpipe = gpu("CPU", "cpu", (2 * GiB, 2 * GiB, 0, True))
    virtio = gpu("VIRTUAL_GPU", "virt", (4 * GiB, None, None, True))
    assert vulkan_devices(llvmpipe) == []
    assert vulkan_devices(llvmpipe + virtio)[0]["type"] == "virtual"
    assert vulkan_devices(virtio + gpu("DISCRETE_GPU", "d", (8 * GiB, None, None, True))) == \
        [{"total": 8 * GiB, "free": 8 * GiB, "budget": False, "type": "discrete"}]


def test_visible_devices_index_every_device_lavapipe_included():
    # A host with a discrete GPU after Mesa's lavapipe (GPU0), as vulkaninfo lists them.
    llvmpipe = gpu("CPU", "cpu", (24 * GiB, 23 * GiB, 1 * GiB, True))
    card = gpu("DISCRETE_GPU", "d", (8 * GiB, None, None, True))
    records = llvmpipe + card
    mem = {"vulkan": vulkan_devices(records), "vulkan_all": vulkan_every_device(records)}
    # ggml on its own: the card is Vulkan0 and lavapipe is never used.
    assert device_free(mem, "vulkan", "Vulkan0").split == 8 * GiB
    assert device_free(mem, "vulkan", "Vulkan1") is None
    # GGML_VK_VISIBLE_DEVICES=0,1: lavapipe is Vulkan0, the card Vulkan1.
    assert device_free(mem, "vulkan", "Vulkan0", (0, 1)).split == 22 * GiB
    assert device_free(mem, "vulkan", "Vulkan1", (0, 1)).split == 8 * GiB
    # An index vulkaninfo did not list has no memory, and does not borrow another's.
    assert device_free(mem, "vulkan", "Vulkan0", (5,)) is None


def test_overused_heap_has_nothing_free_and_zero_budget_means_no_extension():
    assert vulkan_devices(gpu("DISCRETE_GPU", "u", (8 * GiB, 6 * GiB, 7 * GiB, True)))[0]["free"] \
        == 0
    # vulkaninfo before 1.2.148 printed budget/usage 0 on drivers without VK_EXT_memory_budget.
    old = vulkan_devices(gpu("DISCRETE_GPU", "u", (8 * GiB, 0, 0, True)))[0]
    assert (old["free"], old["budget"]) == (8 * GiB, False)


def test_cut_short_gpu_keeps_its_place():
    first = gpu("DISCRETE_GPU", "a", (24 * GiB, 20 * GiB, 0, True))
    cut = [["gpu", "1"], ["type", "PHYSICAL_DEVICE_TYPE_DISCRETE_GPU"], ["uuid", "b"]]
    assert vulkan_devices(first + cut)[1] is None
    assert vulkan_devices(first + cut)[0]["free"] == 20 * GiB


# -- the fact's command, run against stand-in tools ------------------------------------------------

VULKANINFO = """\
==========
VULKANINFO
==========

Vulkan Instance Version: 1.3.280

Layers: count = 1
=================
VK_LAYER_MESA_device_select (Linux device selection layer) Vulkan version 1.3.211, layer version 1:
\tDevices: count = 2
\t\tGPU id = 0 (AMD Radeon RX 7900 XTX (RADV NAVI31))
\t\tGPU id = 1 (llvmpipe (LLVM 17.0.6, 256 bits))

Device Properties and Extensions:
=================================
GPU0:
VkPhysicalDeviceProperties:
---------------------------
\tapiVersion        = 1.3.278 (4206870)
\tvendorID          = 0x1002
\tdeviceType        = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU
\tdeviceName        = AMD Radeon RX 7900 XTX (RADV NAVI31)

VkPhysicalDeviceIDProperties:
-----------------------------
\tdeviceUUID      = 00000000-0300-0000-0000-000000000000
\tdriverUUID      = 414d442d-4d45-5341-2d44-525600000000

VkQueueFamilyProperties:
========================
\tqueueProperties[0]:
\t-------------------
\t\tminImageTransferGranularity = (1,1,1)
\t\tqueueCount                  = 1

VkPhysicalDeviceMemoryProperties:
=================================
memoryHeaps: count = 2
\tmemoryHeaps[0]:
\t\tsize   = 25753026560 (0x5feff0000) (23.98 GiB)
\t\tbudget = 24962596864 (0x5cfe00000) (23.25 GiB)
\t\tusage  = 26435584 (0x01936000) (25.21 MiB)
\t\tflags: count = 1
\t\t\tMEMORY_HEAP_DEVICE_LOCAL_BIT
\tmemoryHeaps[1]:
\t\tsize   = 33406607360 (0x7c7400000) (31.11 GiB)
\t\tbudget = 29312036864 (0x6d3200000) (27.30 GiB)
\t\tusage  = 0 (0x00000000) (0.00 B)
\t\tflags:
\t\t\tNone
memoryTypes: count = 2
\tmemoryTypes[0]:
\t\theapIndex     = 0
\t\tpropertyFlags = 0x0001: count = 1
\t\t\tMEMORY_PROPERTY_DEVICE_LOCAL_BIT
\tmemoryTypes[1]:
\t\theapIndex     = 1
\t\tpropertyFlags = 0x0006: count = 2
\t\t\tMEMORY_PROPERTY_HOST_VISIBLE_BIT
\t\t\tMEMORY_PROPERTY_HOST_COHERENT_BIT

GPU1:
VkPhysicalDeviceProperties:
---------------------------
\tdeviceType        = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName        = llvmpipe (LLVM 17.0.6, 256 bits)

VkPhysicalDeviceMemoryProperties:
=================================
memoryHeaps: count = 1
\tmemoryHeaps[0]:
\t\tsize   = 2147483648 (0x80000000) (2.00 GiB)
\t\tbudget = 2147483648 (0x80000000) (2.00 GiB)
\t\tusage  = 0 (0x00000000) (0.00 B)
\t\tflags: count = 1
\t\t\tMEMORY_HEAP_DEVICE_LOCAL_BIT
memoryTypes: count = 1
"""

ROCM_SMI = """\
device,VRAM Total Memory (B),VRAM Total Used Memory (B)
card0,68702699520,10960896
card1,68702699520,3422552064
"""

VM_STAT = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                                3215.
Pages active:                            298137.
Pages inactive:                          294830.
Pages speculative:                         2513.
Pages wired down:                        142087.
"Translation faults":                 317718459.
"""

SYSCTL = """\
[ "$1" = -n ] || exit 2
case "$2" in
  hw.memsize) echo 68719476736 ;;
  hw.optional.arm64) echo 1 ;;
  iogpu.wired_limit_mb) echo 57344 ;;
  *) echo "sysctl: unknown oid '$2'" >&2; exit 1 ;;
esac
"""

# The host's own awk, then every other implementation at hand (hosts run gawk, mawk, BSD awk or
# busybox awk): the filters must read the same on each.
AWKS = ["awk"] + [a for a in ("gawk", "mawk", "busybox") if shutil.which(a)]


def tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def run_fact(bin_dir: Path, awk: str | None = None, shell: str = "sh") -> list[str]:
    if awk == "busybox":
        tool(bin_dir, "awk", 'exec busybox awk "$@"\n')
    elif awk and awk != "awk":
        tool(bin_dir, "awk", f'exec {shutil.which(awk)} "$@"\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run([*shell.split(), "-c", DeviceMemory().command()], env=env,
                          capture_output=True, text=True, timeout=30, check=True)
    return done.stdout.splitlines()


@pytest.fixture
def bin_dir(tmp_path):
    path = tmp_path / "bin"
    path.mkdir()
    return path


@pytest.mark.parametrize("awk", AWKS)
def test_command_filters_gpu_tools(bin_dir, tmp_path, awk):
    (tmp_path / "vulkaninfo.txt").write_text(VULKANINFO)
    (tmp_path / "rocm.csv").write_text(ROCM_SMI)
    # The tools also write to stderr and exit non-zero at times; neither may reach the probe.
    tool(bin_dir, "vulkaninfo", f"cat {tmp_path}/vulkaninfo.txt; echo 'ERROR: no display' >&2\n")
    tool(bin_dir, "rocm-smi", f'[ "$*" = "--showmeminfo vram --csv" ] && cat {tmp_path}/rocm.csv'
                              "; exit 1\n")
    # Two processes on the first GPU: one named as an rpc-server, one not.
    shutil.copy(shutil.which("sleep"), bin_dir / "ggml-rpc-server")
    shutil.copy(shutil.which("sleep"), bin_dir / "python3")
    worker = subprocess.Popen([bin_dir / "ggml-rpc-server", "30"])
    other = subprocess.Popen([bin_dir / "python3", "30"])
    tool(bin_dir, "nvidia-smi", 'case "$1" in --query-gpu=*) '
                                'echo "24564, 23940, GPU-aaaa"; echo "[N/A], [N/A], [N/A]"; '
                                'echo "16376, 15800, GPU-cccc" ;; '
                                f'--query-compute-apps=*) echo "{worker.pid}, 4200, GPU-aaaa"; '
                                f'echo "{other.pid}, 900, GPU-aaaa" ;; esac\n')
    try:
        lines = run_fact(bin_dir, awk)
    finally:
        worker.kill(), other.kill(), worker.wait(), other.wait()
    # Only the few filtered lines travel, never the dump.
    assert not [x for x in lines if x.split()[0] not in ("MemTotal:", "MemAvailable:", "cuda",
                                                         "cudaheld", "rocm", "vk")], lines
    # Neither runs in one of meshdeploy's units: the memory stays theirs (see the cgroup test).
    assert not [x for x in lines if x.startswith("cudaheld")], lines
    assert len(lines) < 40
    mem = DeviceMemory().process(lines)
    assert mem["vulkan"] == [{"total": 25753026560, "free": 24962596864 - 26435584,
                              "budget": True, "type": "discrete"}]
    assert mem["rocm"] == [{"total": 68702699520, "free": 68702699520 - 10960896},
                           {"total": 68702699520, "free": 68702699520 - 3422552064}]
    assert mem["cuda"] == [{"total": 24564 * MiB, "free": 23940 * MiB, "uuid": "GPU-aaaa",
                            "held": 0, "held_by": 0}, None,
                           {"total": 16376 * MiB, "free": 15800 * MiB, "uuid": "GPU-cccc",
                            "held": 0, "held_by": 0}]
    assert device_free(mem, "cuda", "CUDA0").split == 23940 * MiB - CUDA_CONTEXT
    assert mem["metal"] is None
    assert device_free(mem, "vulkan", "Vulkan0").split == 24962596864 - 26435584
    assert device_free(mem, "vulkan", "Vulkan1") is None  # llvmpipe is not a llama.cpp device
    assert device_free(mem, "rocm", "ROCm1").usable == 68702699520 - 3422552064


@pytest.mark.parametrize("awk", AWKS)
def test_command_reads_macos(bin_dir, tmp_path, awk):
    (tmp_path / "vm_stat.txt").write_text(VM_STAT)
    tool(bin_dir, "uname", '[ "$1" = -s ] && echo Darwin\n')
    tool(bin_dir, "sysctl", SYSCTL)
    tool(bin_dir, "vm_stat", f"cat {tmp_path}/vm_stat.txt\n")
    lines = run_fact(bin_dir, awk)
    mac = sorted(x for x in lines if x.startswith("mac "))
    assert mac == ["mac free 3215", "mac hw.memsize 68719476736", "mac hw.optional.arm64 1",
                   "mac inactive 294830", "mac iogpu.wired_limit_mb 57344", "mac page 16384"]
    # Without /proc/meminfo (a real Mac) the CPU comes from sysctl and vm_stat.
    mem = DeviceMemory().process(mac)
    assert mem["cpu"] == {"total": 64 * GiB, "available": (3215 + 294830) * 16384,
                          "source": "sysctl hw.memsize, vm_stat"}
    assert mem["metal"] == {"total": 56 * GiB, "free": 56 * GiB, "estimated": False}


def test_intel_mac_has_no_metal_figure():
    mem = DeviceMemory().process(["mac hw.memsize 34359738368", "mac iogpu.wired_limit_mb 0"])
    assert mem["metal"] is None and mem["cpu"]["total"] == 32 * GiB
    assert device_free(mem, "metal", "MTL0") is None


def test_command_prints_nothing_for_missing_tools(bin_dir):
    lines = run_fact(bin_dir)
    assert all(x.split()[0] in ("MemTotal:", "MemAvailable:") for x in lines), lines


@needs("timeout")
def test_a_hung_tool_is_cut_off(bin_dir):
    tool(bin_dir, "vulkaninfo", "echo GPU0:; exec sleep 60\n")
    started = time.monotonic()
    lines = run_fact(bin_dir)
    assert time.monotonic() - started < 15
    assert "vk gpu 0" in lines


@pytest.mark.system
def test_only_meshdeploys_own_workers_count_their_gpu_memory_as_free(bin_dir, tmp_path):
    """A process named ggml-rpc-server in one of meshdeploy's units (a real cgroup named as
    systemd names them) counts; the same name outside one, and another name inside one, do not:
    a user's own llama-server keeps its memory in the plan's eyes."""
    if os.geteuid() != 0:
        unmet("needs root: makes a cgroup")
    roots = [p for p in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
             if os.path.exists(f"{p}/cgroup.procs") and os.access(p, os.W_OK)]
    if not roots:
        unmet("no writable cgroup hierarchy")
    unit = Path(roots[0]) / "system.slice" / f"meshdeploy-rpc-t{os.getpid()}.service"
    unit.mkdir(parents=True, exist_ok=True)
    shutil.copy(shutil.which("sleep"), bin_dir / "ggml-rpc-server")
    shutil.copy(shutil.which("sleep"), bin_dir / "python3")
    ours = subprocess.Popen([bin_dir / "ggml-rpc-server", "30"])
    stray = subprocess.Popen([bin_dir / "ggml-rpc-server", "30"])
    other = subprocess.Popen([bin_dir / "python3", "30"])
    try:
        for proc in (ours, other):
            (unit / "cgroup.procs").write_text(str(proc.pid))
        assert f"/system.slice/{unit.name}" in Path(f"/proc/{ours.pid}/cgroup").read_text()
        rows = "; ".join(f"echo \"{p.pid}, {m}, GPU-aaaa\"" for p, m in
                         ((ours, 4200), (stray, 700), (other, 900)))
        tool(bin_dir, "nvidia-smi", 'case "$1" in --query-gpu=*) echo "24564, 23940, GPU-aaaa" ;; '
                                    f'--query-compute-apps=*) {rows} ;; esac\n')
        lines = run_fact(bin_dir)
    finally:
        for proc in (ours, stray, other):
            proc.kill(), proc.wait()
        unit.rmdir()
    assert [x for x in lines if x.startswith("cudaheld")] == ["cudaheld 4200 GPU-aaaa"]
    mem = DeviceMemory().process(lines)
    assert mem["cuda"] == [{"total": 24564 * MiB, "free": 23940 * MiB, "uuid": "GPU-aaaa",
                            "held": 4200 * MiB, "held_by": 1}]
    assert device_free(mem, "cuda", "CUDA0").split == (23940 + 4200) * MiB - CUDA_CONTEXT
