"""Facts of the rpc_cache role: the seeding tool and what an rpc-server cache dir holds."""

from __future__ import annotations

import re

from pyinfra.api import FactBase

from meshdeploy.roles.rpc_cache import defaults as d

HEX16 = re.compile(r"^[0-9a-f]{16}$")
# What an interrupted md-rpc-seed or seeding script leaves (operations.seed removes these).
LEFTOVER = re.compile(r"^\.([0-9a-f]{16}\.tmp|meshdeploy-seeded\.tmp|meshdeploy-seed-list(\.out)?)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class SeedTool(FactBase):
    """The installed md-rpc-seed: sha256 of the source it was built from.

    ```python
    {"source_sha256": "<64 hex>"}   # or {"source_sha256": None}: binary there, origin unknown
    ```
    None: no executable at `path`.
    """

    def command(self, path):
        return (f"[ -x {path} ] && echo ok && "
                f"cat {path}{d.rpc_cache_tool_source_suffix} 2>/dev/null; true")

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
        return (f"cd {path} 2>/dev/null || exit 0; echo dir; "
                "set -- $(ls -A); [ $# -gt 0 ] && "
                "{ stat -c 'file %s %n' -- \"$@\" 2>/dev/null || stat -f 'file %z %N' -- \"$@\"; }; "
                f"sed 's/^/marker /' {d.rpc_cache_marker} 2>/dev/null; true")

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


class DeviceMemory(FactBase):
    """Memory of the host's devices, as llama.cpp's backends report it.

    ```python
    {"cpu": {"total": 25769803776, "available": 23622320128},   # /proc/meminfo, bytes
     "cuda": [{"total": 25769803776, "free": 25300041728}]}    # nvidia-smi, in device order
    ```
    None: neither /proc/meminfo nor nvidia-smi answered (macOS, Android without procfs).
    """

    def command(self):
        return ("grep -E '^(MemTotal|MemAvailable):' /proc/meminfo 2>/dev/null; "
                "command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi "
                "--query-gpu=memory.total,memory.free --format=csv,noheader,nounits "
                "2>/dev/null | sed 's/^/cuda /'; true")

    def process(self, output):
        cpu, cuda = {}, []
        for line in output or []:
            words = line.replace(",", " ").split()
            if len(words) == 3 and words[0] in ("MemTotal:", "MemAvailable:") \
                    and words[1].isdigit() and words[2] == "kB":
                cpu["total" if words[0] == "MemTotal:" else "available"] = int(words[1]) * 1024
            elif len(words) == 3 and words[0] == "cuda" and words[1].isdigit() \
                    and words[2].isdigit():
                cuda.append({"total": int(words[1]) << 20, "free": int(words[2]) << 20})
        if not cpu and not cuda:
            return None
        return {"cpu": cpu or None, "cuda": cuda}
