"""Facts of the models role: files on the host, their verified markers, free disk space."""

from __future__ import annotations

from pathlib import Path

from pyinfra.api import FactBase

from meshdeploy.core import probe, shell
from meshdeploy.roles.models import defaults as d

TEMPLATES = Path(__file__).with_name("templates")

# GNU stat, then BSD stat, of "$1": "<size> <mtime>".
_STAT = "st() { stat -c '%s %Y' \"$1\" 2>/dev/null || stat -f '%z %m' \"$1\" 2>/dev/null; }\n"


class ModelFile(FactBase):
    """Size, mtime and verified marker of one model file, and the size of its partial download.

    ```python
    {"size": 253113024, "mtime": 1700000000, "verified": (253113024, 1700000000, "<sha256>"),
     "partial": 1024 or None, "link": "/path/target" or None}
    ```
    None: the file does not exist.
    """

    _BODY = (_STAT + 'echo "file $(st "$F")"; echo "marker $(cat "$M" 2>/dev/null)"\n'
             'echo "part $(st "$P")"; echo "link $(readlink "$F")"')

    def command(self, path):
        return shell.script(self._BODY, F=path, M=f"{path}{d.models_verified_suffix}",
                            P=f"{path}{d.models_partial_suffix}")

    def process(self, output):
        words = {}
        for line in output:
            key, _, rest = line.partition(" ")
            words[key] = rest.split()
        part, stat, marker = (_numbers(words.get(k, [])) for k in ("part", "file", "marker"))
        partial = part[0] if len(part) == 2 else None
        if len(stat) != 2 or None in stat:
            return {"size": None, "mtime": None, "verified": None, "partial": partial,
                    "link": None}
        verified = (marker[0], marker[1], words["marker"][2]) \
            if len(marker) == 3 and None not in marker[:2] else None
        link = words.get("link")
        return {"size": stat[0], "mtime": stat[1], "verified": verified, "partial": partial,
                "link": link[0] if link else None}


def _numbers(words: list[str]) -> list[int | None]:
    return [probe.uint(w) for w in words]


class DiskFree(probe.DiskFree):
    """Free bytes where the models folder is (or its nearest existing parent)."""


class OllamaManifest(FactBase):
    """An Ollama manifest and the blobs it names.

    ```python
    {"manifest": "<json text>", "blobs": {"sha256:<hex>": (size, mtime)},
     "heads": {"sha256:<hex>": "<base64 of the first 64 KiB of a GGUF blob>"},
     "store": "/root/.ollama/models"}
    ```
    None: no such manifest in the store.
    """

    _DEFAULT_STORE = "S=${OLLAMA_MODELS:-$HOME/.ollama/models}\n"

    def command(self, store, registry_path):
        # No store: the login user's ($OLLAMA_MODELS, else ~/.ollama/models); the probe is not
        # root, so this is the store of the user meshdeploy logs in as.
        store_var = {"S": store} if store else {}
        return shell.template(TEMPLATES / "ollama-manifest.sh",
                              prelude=("" if store else self._DEFAULT_STORE) + _STAT,
                              **store_var, R=registry_path)

    def process(self, output):
        out = {"manifest": None, "blobs": {}, "heads": {}, "store": None}
        for line in output:
            key, _, rest = line.partition(" ")
            if key == "store":
                out["store"] = rest.strip()
            elif key == "manifest":
                out["manifest"] = rest
            elif key == "gguf":
                digest, _, head = rest.partition(" ")
                out["heads"][digest] = head.strip()
            elif key == "blob":
                parts = rest.split()
                numbers = _numbers(parts[1:])
                if len(parts) == 3 and None not in numbers:
                    out["blobs"][parts[0]] = tuple(numbers)
        return out if out["manifest"] else None


class Stored(probe.Stored):
    """The model folders under llama_cpp.prefix/models, with their sizes (for destroy).

    ```python
    {"/opt/meshdeploy/models/gemma": 253116416}
    ```
    """
