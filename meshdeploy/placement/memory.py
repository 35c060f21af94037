"""Free memory of one llama.cpp device, as its backend would report it, from the DeviceMemory fact.

llama.cpp splits layers by each device's *reported* free memory when no --tensor-split is given,
so the numbers that matter are the backends' own, not the operating system's:

    ggml-cpu     total physical memory, reported as free too ("assume that all of it is free")
    ggml-cuda    cudaMemGetInfo; ggml-hip the same through hipMemGetInfo
    ggml-vulkan  per device, over the DEVICE_LOCAL heaps (every heap on an integrated GPU):
                 free += heapBudget - heapUsage with VK_EXT_memory_budget, else the heap size
    ggml-metal   recommendedMaxWorkingSetSize - currentAllocatedSize of the process (0 in a
                 freshly started rpc-server, so the whole working set)

The tools read on the host (nvidia-smi, rocm-smi, vulkaninfo, sysctl) see the same driver
numbers without creating a GPU context; for CUDA each process's own context (CUDA_CONTEXT) is
taken off, and what meshdeploy's running rpc-servers and llama-servers hold is counted free
(their restart frees it). Metal's working set cannot be read without Metal code:
it is estimated from the memory size unless iogpu.wired_limit_mb pins it (see metal_working_set).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20

# What a worker's CUDA context takes of its GPU before any buffer: 527 MiB for ggml-cuda's
# rpc-server on an H200 with CUDA 13.0 (its free memory against nvidia-smi's just before it
# started; a process of PyTorch's took 518 MiB there: docs/gpu.md). Smaller GPUs take less, so
# this errs on the safe side there.
CUDA_CONTEXT = 528 * MiB

# A device name is a backend prefix plus an index; the prefix must match the host's backend.
_GPU_LISTS = {"CUDA": ("cuda", "nvidia-smi"), "ROCm": ("rocm", "rocm-smi"),
              "Vulkan": ("vulkan", "vulkaninfo")}


@dataclass(frozen=True)
class DeviceFree:
    split: int  # what llama.cpp reports as free: drives the automatic layer split
    usable: int  # what the headroom check should count on
    source: str  # where the number comes from, for messages ("rocm-smi", "sysctl (estimated)")
    estimated: bool  # not read but derived by a rule that may be off (Metal without a wired limit)


def device_free(mem: dict | None, backend: str, device: str,
                vulkan_visible: tuple[int, ...] = ()) -> DeviceFree | None:
    """Free memory of `device` on a host with `backend`, from the decoded DeviceMemory fact.

    + mem: the rpc_cache.DeviceMemory value of the host (None when not probed)
    + backend: the host's backend (cpu, cuda, metal, vulkan, rocm)
    + device: llama.cpp's device name (CPU, CUDA0, ROCm1, Vulkan0, MTL0)
    + vulkan_visible: the host's vulkan_visible_devices: Vulkan<i> is vulkaninfo's GPU
      vulkan_visible[i] (every device's memory, "vulkan_all"), not ggml's own i-th choice

    ```python
    device_free({"cpu": {"total": 68719476736, "available": 60129542144,
                         "source": "/proc/meminfo"}}, "cuda", "CPU")
    # DeviceFree(split=68719476736, usable=60129542144, source="/proc/meminfo", estimated=False)
    device_free({"rocm": [{"total": 25753026560, "free": 25726590976}]}, "rocm", "ROCm0")
    # DeviceFree(split=25726590976, usable=25726590976, source="rocm-smi", estimated=False)
    ```
    None: not probed, the tool gave nothing for that device, or a device this backend has not.
    """
    if not mem:
        return None
    if device == "CPU" or (backend == "cpu" and device.startswith("CPU")):
        cpu = mem.get("cpu") or {}
        total = cpu.get("total")
        if total is None:
            return None
        # ggml-cpu offers all physical memory to the split; what is really free bounds headroom.
        available = cpu.get("available")
        return DeviceFree(total, total if available is None else available,
                          cpu.get("source", "/proc/meminfo"), False)
    if device == "MTL0" and backend == "metal":
        metal = mem.get("metal")
        if not metal:
            return None
        estimated = bool(metal.get("estimated"))
        return DeviceFree(metal["free"], metal["free"],
                          "sysctl (estimated)" if estimated else "sysctl iogpu.wired_limit_mb",
                          estimated)
    for prefix, (key, source) in _GPU_LISTS.items():
        index = device[len(prefix):]
        if device.startswith(prefix) and index.isdigit() and backend == key:
            gpus = mem.get(key) or []
            if key == "vulkan" and vulkan_visible:
                every = mem.get("vulkan_all") or []
                gpus = [every[i] if i < len(every) else None for i in vulkan_visible]
            gpu = gpus[int(index)] if int(index) < len(gpus) else None
            if not gpu:
                return None
            if key == "cuda":
                # What cudaMemGetInfo tells the worker or llama-server once it runs: what
                # meshdeploy's running processes there hold is free again at their restart, and
                # each one's own CUDA context is not (nvidia-smi reads the driver without making
                # one; at least the one process the plan places there).
                contexts = max(gpu.get("held_by", 0), 1)
                free = max(gpu["free"] + gpu.get("held", 0) - contexts * CUDA_CONTEXT, 0)
                return DeviceFree(free, free, f"{source}, less a CUDA context", False)
            return DeviceFree(gpu["free"], gpu["free"], source, False)
    return None


# -- decoding what the probe carries (pure helpers of DeviceMemory.process) -----------------------

def metal_working_set(memsize: int | None, wired_limit: int | None) -> tuple[int, bool] | None:
    """(recommendedMaxWorkingSetSize in bytes, estimated) of an Apple-silicon Mac.

    With iogpu.wired_limit_mb set (wired_limit, in bytes here) Metal reports exactly that limit
    (a 128 GiB Mac with 114688 reports 112.00 GiB). Without it the value is macOS's own default,
    which is not published; the estimate takes 2/3 of memory up to 36 GiB and 3/4 above, the
    values macOS 13-14 reported (16 GiB: 11453 MB, 32 GiB: 21845 MiB, 64 GiB: 49152 MiB,
    96 GiB: 73728 MiB). Later releases report more on large machines (64 GiB: about 55662 MB,
    128 GiB: about 107.5 GiB), so the estimate errs low, the safe side of a fit check.
    """
    if wired_limit:
        return (min(wired_limit, memsize) if memsize else wired_limit), False
    if not memsize:
        return None
    return (memsize * 2 // 3 if memsize <= 36 * GiB else memsize * 3 // 4), True


def vulkan_devices(records: list[list[str]]) -> list[dict | None]:
    """The devices ggml-vulkan would number Vulkan0, Vulkan1, ... on its own, with their memory.

    `records` are the filtered vulkaninfo lines without their "vk" word:
    ["gpu", "0"], ["type", "PHYSICAL_DEVICE_TYPE_DISCRETE_GPU"], ["uuid", "<uuid>"], ["heap"],
    ["size", "<bytes>"], ["budget", "<bytes>"], ["usage", "<bytes>"], ["local"].
    Selection follows ggml_vk_instance_init without GGML_VK_VISIBLE_DEVICES: discrete and
    integrated GPUs in enumeration order, one per device UUID (ggml prefers a driver by vendor
    table; the memory is the same GPU's either way), else the first device that is not a CPU.
    A selected device whose heaps did not arrive (vulkaninfo cut short) stays as None, so the
    indices of the others do not shift.
    """
    gpus = _vulkan_gpus(records)
    chosen, seen = [], set()
    for gpu in gpus:
        kind = _device_type(gpu["type"])
        if kind in ("discrete", "integrated") and (gpu["uuid"] is None or gpu["uuid"] not in seen):
            chosen.append(gpu)
            seen.add(gpu["uuid"])
    if not chosen:
        chosen = [g for g in gpus if _device_type(g["type"]) in ("virtual", "other")][:1]
    return [_vulkan_memory(gpu) for gpu in chosen]


def vulkan_every_device(records: list[list[str]]) -> list[dict | None]:
    """Every device vulkaninfo lists (GPU0, GPU1, ...), CPU drivers such as lavapipe included,
    with its memory: what GGML_VK_VISIBLE_DEVICES indexes (hosts.NAME.vulkan_visible_devices)."""
    return [_vulkan_memory(gpu) for gpu in _vulkan_gpus(records)]


def _vulkan_gpus(records: list[list[str]]) -> list[dict]:
    gpus: list[dict] = []
    heap = None
    for words in records:
        kind = words[0] if words else ""
        if kind == "gpu":
            gpus.append({"type": None, "uuid": None, "heaps": []})
            heap = None
        elif not gpus:
            continue
        elif kind in ("type", "uuid") and len(words) == 2 and gpus[-1][kind] is None:
            gpus[-1][kind] = words[1]
        elif kind == "heap":
            heap = {"size": None, "budget": None, "usage": None, "local": False}
            gpus[-1]["heaps"].append(heap)
        elif heap is not None and kind in ("size", "budget", "usage") and len(words) == 2 \
                and words[1].isdigit():
            heap[kind] = int(words[1])
        elif heap is not None and kind == "local":
            heap["local"] = True
    return gpus


def _device_type(text: str | None) -> str | None:
    for word in ("DISCRETE", "INTEGRATED", "VIRTUAL", "CPU", "OTHER"):
        if text and word in text:
            return word.lower()
    return None


def _vulkan_memory(gpu: dict) -> dict | None:
    integrated = _device_type(gpu["type"]) == "integrated"
    heaps = [h for h in gpu["heaps"] if h["size"] is not None and (integrated or h["local"])]
    if not heaps:
        return None
    # Old vulkaninfo prints budget 0 when VK_EXT_memory_budget is missing: no budget at all.
    budget = any(h["budget"] for h in heaps)
    free = 0
    for h in heaps:
        if budget and h["budget"] is not None and h["usage"] is not None:
            # ggml subtracts unsigned and would wrap past zero; an over-used heap has nothing free.
            free += max(h["budget"] - h["usage"], 0)
        else:
            free += h["size"]
    return {"total": sum(h["size"] for h in heaps), "free": free, "budget": budget,
            "type": _device_type(gpu["type"])}
