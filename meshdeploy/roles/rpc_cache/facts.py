"""Facts of the rpc_cache role: the seeding tool and what an rpc-server cache dir holds."""

from __future__ import annotations

import re

from pyinfra.api import FactBase

from meshdeploy.core import probe, shell
from meshdeploy.placement.memory import metal_working_set, vulkan_devices, vulkan_every_device
from meshdeploy.roles.rpc_cache import defaults as d

HEX16 = re.compile(r"\A[0-9a-f]{16}\Z")
# What an interrupted md-rpc-seed or seeding script leaves (operations.seed removes these).
LEFTOVER = re.compile(r"\A\.([0-9a-f]{16}\.tmp|meshdeploy-seeded\.tmp"
                      r"|meshdeploy-seed-list(\.out|\.[0-9]+(\.m)?)?)\Z")
_SHA256 = re.compile(r"\A[0-9a-f]{64}\Z")
# A file a service user may write, as lines a probe can carry: bytes that are not printable
# ASCII become "?" (what arrives must decode as UTF-8: paramiko is strict) and lines are cut at
# 256 characters (a marker or digest list line is shorter).
_PRINTABLE = "export LC_ALL=C\nprintable() { tr -c '\\n -~' '?' | cut -c 1-256; }"


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


# A marker holds one ~100-byte line per seeded tensor: 16 MiB is some 160,000 tensors.
_MARKER_MOST = 16 * 1024 * 1024


class CacheDir(FactBase):
    """Entries of one rpc-server cache dir, its leftovers and the seeding marker.

    ```python
    {"entries": {"f42cfb619b3cade9": 178257920},      # 16-hex names rpc-server serves
     "temporary": [".f42cfb619b3cade9.tmp"],          # left by an interrupted seeding
     "marker": [("<gguf sha256>", 6527680, 178257920, "f42cfb619b3cade9")]}
    ```
    Two keys appear only when the folder's service user left something odd (it owns the folder,
    and this fact runs as root; on a rootless host, both are the login user):
    - "link": True: the folder itself is a symbolic link (or was swapped for one while being
      read); nothing in it was listed or read, entries/temporary/marker are empty. Seeding must
      refuse such a folder, never write through it.
    - "damaged": ["line 2: 'x y 3 f42cfb619b3cade9'", "the marker is a symbolic link; not
      read", ...]: marker lines that are not marker records (the first few, quoted, then a
      count), skipped, for the plan to warn about.
    Only regular files whose names rpc-server or seeding use are listed, so a name cannot
    forge a line. None: the directory does not exist.
    """

    # The folder by its physical path, compared with its parent's: a link swapped in after the
    # -L test is caught, and once inside only relative names are used.
    _LIST = r"""[ -L "$D" ] && { echo link; exit 0; }
cd -P "$D" 2>/dev/null || exit 0
P=$(cd -P "${D%/*}/" && pwd -P) && [ "$(pwd -P)" = "${P%/}/${D##*/}" ] || { echo link; exit 0; }
echo dir
if stat -c %s . >/dev/null 2>&1; then F=-c S='file %s %n'; else F=-f S='file %z %N'; fi
find . -maxdepth 1 -type f \( -name "$H" -o -name ".$H.tmp" -o -name '.meshdeploy-seed*' \) \
  ! -name '*[!0-9a-z.-]*' -exec stat "$F" "$S" {} + 2>/dev/null
"""
    # The probe runs as root: the marker is read as the folder's owner.
    _MARKER_AS_OWNER = r"""o=$(stat -c %u . 2>/dev/null || stat -f %u .); g=$(stat -c %g . 2>/dev/null || stat -f %g .)
if [ -L "$MARKER" ]; then echo markerlink
elif [ ! -f "$MARKER" ]; then :
elif [ "$o" = 0 ]; then head -c "$MOST" < "$MARKER" | printable | sed 's/^/marker /'
elif command -v setpriv >/dev/null 2>&1; then
  # Read as the folder's owner, from inside it: whatever it swaps in after the tests above (a
  # link to root's file, a FIFO), it reads nothing it could not read itself, and not forever.
  t=; command -v timeout >/dev/null 2>&1 && t="timeout 10"
  $t setpriv --reuid="$o" --regid="$g" --clear-groups sh -c 'exec head -c "$1" < "$2"' \
    read "$MOST" "./$MARKER" | printable | sed 's/^/marker /'
else echo markerunread
fi; true"""
    # A rootless host: the probe runs as the login user, who runs the rpc-server too and owns
    # the folder; setpriv could not clear its groups. Read as itself, the marker gives nothing
    # the user could not read anyway, from inside the folder, and not forever.
    _MARKER_AS_USER = r"""if [ -L "$MARKER" ]; then echo markerlink
elif [ -f "$MARKER" ]; then
  t=; command -v timeout >/dev/null 2>&1 && t="timeout 10"
  $t sh -c 'exec head -c "$1" < "$2"' read "$MOST" "./$MARKER" | printable | sed 's/^/marker /'
fi; true"""

    def command(self, path, as_user=False):
        """+ as_user: the folder is the login user's (a rootless host), not a service user's
        that a root probe reads as."""
        # One stat for every file (a cache holds hundreds of entries); GNU stat, else BSD stat.
        body = self._LIST + (self._MARKER_AS_USER if as_user else self._MARKER_AS_OWNER)
        return shell.script(body, prelude=_PRINTABLE, D=path, MARKER=d.rpc_cache_marker,
                            H="[0-9a-f]" * 16, MOST=_MARKER_MOST)

    def process(self, output):
        head = output[0].strip() if output else ""
        out = {"entries": {}, "temporary": [], "marker": []}
        if head == "link":
            return {**out, "link": True}
        if head != "dir":
            return None
        notes, rejected, number = [], [], 0
        for line in output[1:]:
            kind, _, rest = line.partition(" ")
            if kind == "file":
                size, _, name = rest.partition(" ")
                size, name = probe.uint(size), name.removeprefix("./")
                if size is not None and HEX16.match(name):
                    out["entries"][name] = size
                elif size is not None and LEFTOVER.match(name):
                    out["temporary"].append(name)
            elif kind == "marker":
                number += 1
                record = _marker_record(rest.split())
                if record:
                    out["marker"].append(record)
                else:
                    rejected.append((number, rest))
            elif line.strip() == "markerlink":
                notes.append("the marker is a symbolic link; not read")
            elif line.strip() == "markerunread":
                notes.append("the marker is another user's and setpriv is missing; not read")
        out["temporary"].sort()
        notes += probe.damaged(rejected)
        return {**out, "damaged": notes} if notes else out


def _marker_record(parts: list[str]) -> tuple | None:
    offset, size = (probe.uint(p) for p in parts[1:3]) if len(parts) == 4 else (None, None)
    if offset is None or size is None or not HEX16.match(parts[3]):
        return None
    return parts[0], offset, size, parts[3]


class CacheFree(probe.DiskFree):
    """Free bytes where rpc-server caches live (Layout.cache: /var/cache, a rootless host's
    ~/.cache/meshdeploy; or its nearest existing parent)."""


class Digests(FactBase):
    """The per-tensor digest lists of the models this host shares (made by rpc_cache.share
    from its sha256-verified copy), by model name.

    ```python
    {"gemma": {"<gguf sha256>": [[6527680, 178257920, "f42cfb619b3cade9", "<sha256>"]]}}
    ```
    A model without a list is absent; a damaged line is skipped (the list then covers less and
    is made again). None: no list at all.
    """

    _BODY = r"""while [ $# -ge 2 ]; do
  [ -f "$2" ] && echo "model $1" && printable < "$2" | sed 's/^/line /'; shift 2
done; true"""

    def command(self, paths):
        # Arguments: model name, list path, ... ; names are the cluster file's model keys.
        return shell.script(self._BODY, prelude=_PRINTABLE,
                            args=[w for name, path in sorted(paths.items()) for w in (name, path)])

    def process(self, output):
        out: dict = {}
        model, rejected, number = None, [], 0
        for line in output or []:
            kind, _, rest = line.partition(" ")
            parts = rest.split()
            if kind == "model" and len(parts) == 1:
                model, rejected, number = out.setdefault(parts[0], {}), [], 0
            elif kind == "line" and model is not None:
                number += 1
                record = _digest_record(parts)
                if record:
                    model.setdefault(parts[0], []).append(record)
                else:
                    rejected.append((number, rest))
                    model["damaged"] = probe.damaged(rejected)
        return out or None


def _digest_record(parts: list[str]) -> list | None:
    """[offset, size, fnv16, sha256] of a digest list line's words, after the model's sha."""
    if len(parts) != 5 or not (_SHA256.match(parts[0]) and HEX16.match(parts[3])
                               and _SHA256.match(parts[4])):
        return None
    offset, size = probe.uint(parts[1]), probe.uint(parts[2])
    return None if offset is None or size is None else [offset, size, parts[3], parts[4]]


# nvidia-smi's GPU (or MIG instance) uuid: anything else ("[N/A]") names no GPU.
_GPU_UUID = re.compile(r"(GPU|MIG)-[0-9A-Fa-f-]+")


class DeviceMemory(FactBase):
    """Memory of the host's devices, as llama.cpp's backends report it (bytes, device order).

    ```python
    {"cpu": {"total": 25769803776, "available": 23622320128,       # ggml-cpu offers "total"
             "source": "/proc/meminfo"},                          # or "sysctl hw.memsize"
     "cuda": [{"total": 25769803776, "free": 25300041728,         # nvidia-smi
               "uuid": "GPU-5401a293-...", "held": 0, "held_by": 0}],  # its services hold
     "rocm": [{"total": 25753026560, "free": 25726590976}],       # rocm-smi: total - used
     "vulkan": [{"total": 25769803776, "free": 25012305920,       # vulkaninfo, the devices
                 "budget": True, "type": "discrete"}],            # ggml-vulkan numbers
     "vulkan_all": [{"total": 25769803776, ...}],   # every device, vulkaninfo's GPU<n> order
     "metal": {"total": 11453246122, "free": 11453246122, "estimated": True}}   # sysctl
    ```
    A GPU list holds None where a device's row was unreadable, so later indices keep their
    device. Formats relied on, after the host-side filters below:
    - nvidia-smi --query-gpu=memory.total,memory.free,uuid --format=csv,noheader,nounits:
      "143771, 143156, GPU-5401a293-bda0-d09b-65b9-5c6360c76852" (MiB), one row per GPU in
      nvidia-smi order (rows without the uuid, as earlier probes sent them, still read);
      --query-compute-apps=pid,used_memory,gpu_uuid: "551, 10758, GPU-5401a293-..." (MiB) per
      process, kept for meshdeploy's rpc-servers and llama-servers ("held": what they hold,
      their contexts included; "held_by": how many).
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
    # The shell's own read loop: no process (the probe runs on every host of every plan).
    _MEMINFO = ("[ -r /proc/meminfo ] && while IFS= read -r l; do case \"$l\" in "
                "MemTotal:*|MemAvailable:*) printf '%s\\n' \"$l\" ;; esac; done < /proc/meminfo")
    # Each GPU with its uuid, then what meshdeploy's running rpc-servers and llama-servers hold
    # on each: a process of that name in one of meshdeploy's units (its cgroup: system units, or
    # the probing user's own), read by the shell from /proc (no process per line). What a
    # running cluster holds is not taken from what the plan may place (a restart frees it);
    # anyone else's process keeps its memory.
    _NVIDIA = ("command -v nvidia-smi >/dev/null 2>&1 && { $t nvidia-smi "
               "--query-gpu=memory.total,memory.free,uuid --format=csv,noheader,nounits "
               "2>/dev/null | sed 's/^/cuda /'; U=$(id -u 2>/dev/null); $t nvidia-smi "
               "--query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits "
               "2>/dev/null | while IFS=', ' read -r p u g; do "
               "case \"$p\" in ''|*[!0-9]*) continue ;; esac; c=; k=; "
               "[ -r \"/proc/$p/comm\" ] && read -r c < \"/proc/$p/comm\"; case \"$c\" in "
               "ggml-rpc-server|rpc-server|llama-server) ;; *) continue ;; esac; "
               "[ -r \"/proc/$p/cgroup\" ] && while IFS= read -r l; do case \"$l\" in "
               "*/system.slice/meshdeploy-*|*\"/user@$U.service/\"*/meshdeploy-*) k=1 ;; esac; "
               "done < \"/proc/$p/cgroup\"; [ -n \"$k\" ] && echo \"cudaheld $u $g\"; done; }")
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
    _MACOS = ("command -v vm_stat >/dev/null 2>&1 && command -v sysctl >/dev/null 2>&1 && { "
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
        held: dict[str, tuple] = {}  # GPU uuid -> (bytes, processes) of meshdeploy's own
        for line in output or []:
            words = line.replace(",", " ").split()
            n = [probe.uint(w) for w in words]
            if len(words) == 3 and words[0] in ("MemTotal:", "MemAvailable:") \
                    and n[1] is not None and words[2] == "kB":
                cpu["total" if words[0] == "MemTotal:" else "available"] = n[1] * 1024
            elif words and words[0] == "cuda":
                # By comma: "[N/A]" or "[Not Supported]" rows keep their place (CUDA1 must not
                # take CUDA0's numbers); rows without the uuid are an earlier probe's.
                cols = [c.strip() for c in line.split(None, 1)[1].split(",")] \
                    if len(words) > 1 else []
                nums = [probe.uint(c) for c in cols[:2]]
                if len(cols) in (2, 3):  # a GPU's row; a driver's message is none
                    gpu = {"total": nums[0] << 20, "free": nums[1] << 20} \
                        if None not in nums else None
                    if gpu and len(cols) == 3 and _GPU_UUID.fullmatch(cols[2]):
                        gpu["uuid"], gpu["held"], gpu["held_by"] = cols[2], 0, 0
                    cuda.append(gpu)
            elif len(words) == 3 and words[0] == "cudaheld" and n[1] is not None:
                bytes_, count = held.get(words[2], (0, 0))
                held[words[2]] = (bytes_ + (n[1] << 20), count + 1)
            elif len(words) == 4 and words[0] == "rocm":
                ok = None not in n[2:] and n[3] <= n[2]
                rocm.append({"total": n[2], "free": n[2] - n[3]} if ok else None)
            elif words and words[0] == "vk":
                # vulkan_devices reads numbers by str.isdigit(): only ASCII digits reach it.
                numeric = words[1:2] in (["size"], ["budget"], ["usage"])
                vk.append(words[1:2] if numeric and None in n[2:] else words[1:])
            elif len(words) == 3 and words[0] == "mac" and n[2] is not None:
                mac[words[1]] = n[2]
        for gpu in cuda:
            if gpu and "uuid" in gpu:
                gpu["held"], gpu["held_by"] = held.get(gpu["uuid"], (0, 0))
        if cpu:
            cpu["source"] = "/proc/meminfo"
        elif mac.get("hw.memsize"):
            cpu = {"total": mac["hw.memsize"], "source": "sysctl hw.memsize"}
            if "page" in mac and "free" in mac and "inactive" in mac:
                cpu["available"] = (mac["free"] + mac["inactive"]) * mac["page"]
                cpu["source"] = "sysctl hw.memsize, vm_stat"
        vulkan, vulkan_all = vulkan_devices(vk), vulkan_every_device(vk)
        metal = None
        # Intel Macs run Metal on a discrete GPU whose working set no sysctl tells.
        if mac.get("hw.optional.arm64") == 1:
            wired = (mac.get("iogpu.wired_limit_mb") or 0) << 20 \
                or mac.get("debug.iogpu.wired_limit") or 0
            working_set = metal_working_set(mac.get("hw.memsize"), wired)
            if working_set:
                metal = {"total": working_set[0], "free": working_set[0],
                         "estimated": working_set[1]}
        if not cpu and not any(cuda) and not any(rocm) and not any(vulkan_all) \
                and metal is None:
            return None
        return {"cpu": cpu or None, "cuda": cuda, "rocm": rocm, "vulkan": vulkan,
                "vulkan_all": vulkan_all, "metal": metal}


class Stored(probe.Stored):
    """rpc-server cache folders (/var/cache/meshdeploy-rpc-*, and the DynamicUser's real
    folders under /var/cache/private) and the seeding tool, with their sizes (for destroy).

    ```python
    {"/var/cache/private/meshdeploy-rpc-50052": 180355072, "/var/cache/meshdeploy-rpc-50052": 0}
    ```
    """
