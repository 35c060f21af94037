"""Facts of the rpc_cache role: the seeding tool and what an rpc-server cache dir holds."""

from __future__ import annotations

import re

from pyinfra.api import FactBase

from meshdeploy.deploy import probe, shell
from meshdeploy.roles.rpc_cache import defaults as d
from meshdeploy.roles.rpc_cache.memory import metal_working_set, vulkan_devices

HEX16 = re.compile(r"\A[0-9a-f]{16}\Z")
# What an interrupted md-rpc-seed or seeding script leaves (operations.seed removes these).
LEFTOVER = re.compile(r"\A\.([0-9a-f]{16}\.tmp|meshdeploy-seeded\.tmp"
                      r"|meshdeploy-seed-list(\.out|\.[0-9]+(\.m)?)?)\Z")
_SHA256 = re.compile(r"\A[0-9a-f]{64}\Z")


class SeedTool(FactBase):
    """The installed md-rpc-seed: sha256 of the source it was built from.

    ```python
    {"source_sha256": "<64 hex>"}   # or {"source_sha256": None}: binary there, origin unknown
    ```
    None: no executable at `path`.
    """

    def command(self, path):
        return shell.script('[ -x "$T" ] && echo ok && cat "$STAMP" 2>/dev/null; true',
                            T=path, STAMP=f"{path}{d.rpc_cache_tool_source_suffix}")

    def process(self, output):
        if not output or output[0].strip() != "ok":
            return None
        sha = output[1].strip() if len(output) > 1 else ""
        return {"source_sha256": sha if _SHA256.match(sha) else None}


class CacheDir(FactBase):
    """Entries of one rpc-server cache dir, its leftovers and the seeding marker.

    ```python
    {"entries": {"f42cfb619b3cade9": 178257920},      # 16-hex names rpc-server serves
     "temporary": [".f42cfb619b3cade9.tmp"],          # left by an interrupted seeding
     "marker": [("<gguf sha256>", 6527680, 178257920, "f42cfb619b3cade9")]}
    ```
    None: the directory does not exist.
    """

    def command(self, path):
        # One stat for every file (a cache holds hundreds of entries); GNU stat, then BSD stat.
        return shell.script(
            'cd "$D" 2>/dev/null || exit 0; echo dir\n'
            'set -- $(ls -A); [ $# -gt 0 ] && '
            "{ stat -c 'file %s %n' -- \"$@\" 2>/dev/null || stat -f 'file %z %N' -- \"$@\"; }\n"
            "sed 's/^/marker /' \"$MARKER\" 2>/dev/null; true",
            D=path, MARKER=d.rpc_cache_marker)

    def process(self, output):
        if not output or output[0].strip() != "dir":
            return None
        out = {"entries": {}, "temporary": [], "marker": []}
        for line in output[1:]:
            kind, _, rest = line.partition(" ")
            parts = rest.split()
            if kind == "file" and len(parts) == 2 and parts[0].isdigit():
                size, name = int(parts[0]), parts[1]
                if HEX16.match(name):
                    out["entries"][name] = size
                elif LEFTOVER.match(name):
                    out["temporary"].append(name)
            elif kind == "marker" and len(parts) == 4 and parts[1].isdigit() \
                    and parts[2].isdigit() and HEX16.match(parts[3]):
                out["marker"].append((parts[0], int(parts[1]), int(parts[2]), parts[3]))
        out["temporary"].sort()
        return out


class CacheFree(probe.DiskFree):
    """Free bytes where rpc-server caches live (/var/cache, or its nearest existing parent)."""


class Digests(FactBase):
    """The per-tensor digest lists of the models this host shares (made by rpc_cache.share
    from its sha256-verified copy), by model name.

    ```python
    {"gemma": {"<gguf sha256>": [[6527680, 178257920, "f42cfb619b3cade9", "<sha256>"]]}}
    ```
    A model without a list is absent; a damaged line is skipped (the list then covers less and
    is made again). None: no list at all.
    """

    def command(self, paths):
        # Arguments: model name, list path, ... ; names are the cluster file's model keys.
        return shell.script('while [ $# -ge 2 ]; do [ -f "$2" ] && echo "model $1" && '
                            'sed \'s/^/line /\' "$2"; shift 2; done; true',
                            args=[w for name, path in sorted(paths.items()) for w in (name, path)])

    def process(self, output):
        out: dict = {}
        model = None
        for line in output or []:
            kind, _, rest = line.partition(" ")
            parts = rest.split()
            if kind == "model" and len(parts) == 1:
                model = out.setdefault(parts[0], {})
            elif kind == "line" and model is not None and len(parts) == 5 \
                    and _SHA256.match(parts[0]) and parts[1].isdigit() and parts[2].isdigit() \
                    and HEX16.match(parts[3]) and _SHA256.match(parts[4]):
                model.setdefault(parts[0], []).append([int(parts[1]), int(parts[2]), parts[3],
                                                       parts[4]])
        return out or None


class DeviceMemory(FactBase):
    """Memory of the host's devices, as llama.cpp's backends report it (bytes, device order).

    ```python
    {"cpu": {"total": 25769803776, "available": 23622320128,       # ggml-cpu offers "total"
             "source": "/proc/meminfo"},                          # or "sysctl hw.memsize"
     "cuda": [{"total": 25769803776, "free": 25300041728}],       # nvidia-smi
     "rocm": [{"total": 25753026560, "free": 25726590976}],       # rocm-smi: total - used
     "vulkan": [{"total": 25769803776, "free": 25012305920,       # vulkaninfo, the devices
                 "budget": True, "type": "discrete"}],            # ggml-vulkan numbers
     "metal": {"total": 11453246122, "free": 11453246122, "estimated": True}}   # sysctl
    ```
    A GPU list holds None where a device's row was unreadable, so later indices keep their
    device. Formats relied on, after the host-side filters below:
    - nvidia-smi --query-gpu=memory.total,memory.free --format=csv,noheader,nounits:
      "24564, 23940" (MiB), one row per GPU in nvidia-smi order.
    - rocm-smi --showmeminfo vram --csv: a header "device,VRAM Total Memory (B),VRAM Total Used
      Memory (B)" then "card0,25753026560,26435584" (bytes), one row per GPU in rocm-smi order;
      the columns are found by header name.
    - vulkaninfo (text): per "GPU<n>:" section, "deviceType = PHYSICAL_DEVICE_TYPE_...",
      "deviceUUID = ...", then under VkPhysicalDeviceMemoryProperties each "memoryHeaps[i]:"
      with "size = N (0x..) (..)", "budget = ..." and "usage = ..." (only with
      VK_EXT_memory_budget) and its flags (MEMORY_HEAP_DEVICE_LOCAL_BIT), up to "memoryTypes".
    - macOS: sysctl -n hw.memsize, hw.optional.arm64, iogpu.wired_limit_mb (macOS 14+),
      debug.iogpu.wired_limit (bytes, macOS 13); vm_stat "(page size of N bytes)",
      "Pages free:" and "Pages inactive:" (free + inactive is what is available, as psutil counts).
    None: nothing answered at all.
    """

    _TIMEOUT = "t=; command -v timeout >/dev/null 2>&1 && t='timeout 5'"
    _MEMINFO = "grep -E '^(MemTotal|MemAvailable):' /proc/meminfo 2>/dev/null"
    _NVIDIA = ("command -v nvidia-smi >/dev/null 2>&1 && $t nvidia-smi "
               "--query-gpu=memory.total,memory.free --format=csv,noheader,nounits "
               "2>/dev/null | sed 's/^/cuda /'")
    _ROCM = ("command -v rocm-smi >/dev/null 2>&1 && $t rocm-smi --showmeminfo vram --csv "
             "2>/dev/null | awk -F, '$1 == \"device\" { for (i = 2; i <= NF; i++) { "
             "if ($i == \"VRAM Total Memory (B)\") c = i; "
             "if ($i == \"VRAM Total Used Memory (B)\") u = i } next } "
             "c && u && $1 ~ /^card[0-9]+$/ { print \"rocm\", $1, $c, $u }'")
    # Only the few heap lines travel: a full vulkaninfo dump is thousands of lines per GPU.
    _VULKAN = ("command -v vulkaninfo >/dev/null 2>&1 && $t vulkaninfo 2>/dev/null | awk '"
               "NF == 1 && $1 ~ /^GPU[0-9]+:?$/ { g = $1; sub(/:/, \"\", g); "
               "print \"vk gpu\", substr(g, 4); h = 0; next } "
               "$1 == \"deviceType\" || $1 == \"deviceUUID\" { "
               "print \"vk\", ($1 == \"deviceType\" ? \"type\" : \"uuid\"), $3 } "
               "$1 ~ /^memoryHeaps\\[[0-9]+\\]/ { h = 1; print \"vk heap\"; next } "
               "$1 ~ /^memoryType/ { h = 0 } "
               "h && $2 == \"=\" && ($1 == \"size\" || $1 == \"budget\" || $1 == \"usage\") "
               "{ print \"vk\", $1, $3 } "
               "h && /MEMORY_HEAP_DEVICE_LOCAL_BIT/ { print \"vk local\" }'")
    _MACOS = ("[ \"$(uname -s 2>/dev/null)\" = Darwin ] && { "
              "for k in hw.memsize hw.optional.arm64 iogpu.wired_limit_mb debug.iogpu.wired_limit; "
              "do sysctl -n $k 2>/dev/null | sed \"s/^/mac $k /\"; done; "
              "vm_stat 2>/dev/null | awk '/page size of/ { for (i = 1; i < NF; i++) "
              "if ($i == \"of\") print \"mac page\", $(i + 1) } "
              "$1 == \"Pages\" && ($2 == \"free:\" || $2 == \"inactive:\") "
              "{ sub(/:/, \"\", $2); sub(/\\./, \"\", $3); print \"mac\", $2, $3 }'; }")

    def command(self):
        return "; ".join((self._TIMEOUT, self._MEMINFO, self._NVIDIA, self._ROCM, self._VULKAN,
                          self._MACOS, "true"))

    def process(self, output):
        cpu, cuda, rocm, vk, mac = {}, [], [], [], {}
        for line in output or []:
            words = line.replace(",", " ").split()
            if len(words) == 3 and words[0] in ("MemTotal:", "MemAvailable:") \
                    and words[1].isdigit() and words[2] == "kB":
                cpu["total" if words[0] == "MemTotal:" else "available"] = int(words[1]) * 1024
            elif len(words) == 3 and words[0] == "cuda":
                # "[N/A]" rows keep their place: CUDA1 must not take CUDA0's numbers.
                cuda.append({"total": int(words[1]) << 20, "free": int(words[2]) << 20}
                            if words[1].isdigit() and words[2].isdigit() else None)
            elif len(words) == 4 and words[0] == "rocm":
                ok = words[2].isdigit() and words[3].isdigit() and int(words[3]) <= int(words[2])
                rocm.append({"total": int(words[2]), "free": int(words[2]) - int(words[3])}
                            if ok else None)
            elif words and words[0] == "vk":
                vk.append(words[1:])
            elif len(words) == 3 and words[0] == "mac" and words[2].isdigit():
                mac[words[1]] = int(words[2])
        if cpu:
            cpu["source"] = "/proc/meminfo"
        elif mac.get("hw.memsize"):
            cpu = {"total": mac["hw.memsize"], "source": "sysctl hw.memsize"}
            if "page" in mac and "free" in mac and "inactive" in mac:
                cpu["available"] = (mac["free"] + mac["inactive"]) * mac["page"]
                cpu["source"] = "sysctl hw.memsize, vm_stat"
        vulkan = vulkan_devices(vk)
        metal = None
        # Intel Macs run Metal on a discrete GPU whose working set no sysctl tells.
        if mac.get("hw.optional.arm64") == 1:
            wired = (mac.get("iogpu.wired_limit_mb") or 0) << 20 \
                or mac.get("debug.iogpu.wired_limit") or 0
            working_set = metal_working_set(mac.get("hw.memsize"), wired)
            if working_set:
                metal = {"total": working_set[0], "free": working_set[0],
                         "estimated": working_set[1]}
        if not cpu and not any(cuda) and not any(rocm) and not any(vulkan) and metal is None:
            return None
        return {"cpu": cpu or None, "cuda": cuda, "rocm": rocm, "vulkan": vulkan, "metal": metal}


class Stored(probe.Stored):
    """rpc-server cache folders (/var/cache/meshdeploy-rpc-*, and the DynamicUser's real
    folders under /var/cache/private) and the seeding tool, with their sizes (for destroy).

    ```python
    {"/var/cache/private/meshdeploy-rpc-50052": 180355072, "/var/cache/meshdeploy-rpc-50052": 0}
    ```
    """
