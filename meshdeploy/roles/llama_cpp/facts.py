"""Facts of the llama_cpp role: the clone, the installed builds, where the ref points upstream."""

from __future__ import annotations

import hashlib
import re

from pyinfra.api import FactBase

from meshdeploy.core import probe, shell

COMMIT = re.compile(r"[0-9a-f]{40}")
# git options that keep a repository URL or ref from ever being a command: the ext:: transport
# runs programs, and `--` ends option parsing before the positional repository.
GIT_SAFE = ("-c", "protocol.ext.allow=never")


class Source(FactBase):
    """The clone at `path`: HEAD, origin URL, and whether `commit` is present.

    ```python
    {"head": "<40 hex>", "url": "https://...", "has_commit": True}
    ```
    None: no clone there.
    """

    # The probe runs as the login user and the clone belongs to root: git refuses a repository
    # it finds by searching from the working directory and another user owns ("dubious
    # ownership"), but not one named by --git-dir. `-c safe.directory=` is not enough: Debian
    # 11's git (2.30.2, the fix backported) honours safe.directory only from the global and
    # system config (checked in a bullseye lab host). Reading HEAD, the origin URL and an
    # object runs nothing from the repository's config.
    _BODY = ('[ -d "$SRC/.git" ] || exit 0\n'
             'g() { git --git-dir="$SRC/.git" "$@"; }\n'
             'g rev-parse HEAD; g remote get-url origin\n')
    _HAS = 'g cat-file -e "$COMMIT^{commit}" 2>/dev/null && echo has || echo missing'

    def command(self, path, commit=None):
        if commit is None:
            return shell.script(self._BODY + "echo unknown", SRC=path)
        return shell.script(self._BODY + self._HAS, SRC=path, COMMIT=commit)

    def process(self, output):
        if len(output) < 3:
            return None
        return {"head": output[0].strip(), "url": output[1].strip(),
                "has_commit": {"has": True, "missing": False}.get(output[2].strip())}


class CcacheWritable(FactBase):
    """Whether the login user can keep a ccache in `path`: the folder writable, or its nearest
    existing parent writable when it does not exist yet. True / False."""

    def command(self, path):
        return shell.script(
            'd=$P; while [ ! -e "$d" ] && [ "$d" != / ]; do d=$(dirname "$d"); done; '
            '[ -d "$d" ] && [ -w "$d" ] && [ -x "$d" ] && echo yes || echo no', P=path)

    def process(self, output):
        return bool(output) and output[-1].strip() == "yes"


class Builds(FactBase):
    """Installed builds under `builds_dir` and the `current` link.

    ```python
    {"current": "<key>" or None,
     "builds": {"<key>": {"commit": ..., "backend": ..., "rpc_binary": "ggml-rpc-server",
                          "targets": "llama-server ggml-rpc-server", "proto": "7.0.0",
                          "flags": ["--rpc", "-lm", ...],
                          "archive": "<sha256> <bytes>"}}}   # only where it shares the build
    ```
    """

    # archive: the sha256 and size of the build's tarball under ARCHIVES, where this host keeps
    # the builds other hosts copy (llama_cpp.copy). A tarball changed after its sha256 was
    # written (newer than it) is none: its builder packs it again (pack.sh).
    # flags: the words of llama-server --help that start with - or -- at the start of a line
    # or after a space or comma; one awk reads the manifest and them (it was six processes).
    _BODY = ('for m in "$BUILDS"/*/manifest; do [ -f "$m" ] || continue; '
             'd=${m%/manifest}; echo "== ${d##*/}"; h="$d/llama-server.help"; '
             '[ -f "$h" ] && [ -r "$h" ] || h=/dev/null; '
             # awk stops at a file it cannot open: an unreadable manifest is left out.
             'if [ -r "$m" ]; then set -- "$m" "$h"; else set -- "$h"; fi; '
             "M=$m awk 'FILENAME == ENVIRON[\"M\"] { print; next } "
             '{ l = " " $0; while (match(l, /[ ,]--?[a-zA-Z][a-zA-Z0-9-]*/)) { '
             "f[substr(l, RSTART + 1, RLENGTH - 1)] = 1; l = substr(l, RSTART + RLENGTH) } } "
             'END { printf "flags="; for (k in f) printf "%s ", k; print "" }\' "$@"; '
             'a="$ARCHIVES/${d##*/}.tar.gz"; [ -z "$ARCHIVES" ] || [ ! -f "$a.sha256" ] || '
             '[ ! -f "$a" ] || '
             '[ -n "$(find "$a" -newer "$a.sha256" 2>/dev/null)" ] || '
             'echo "archive=$(cut -c1-64 "$a.sha256") $(wc -c < "$a" | tr -d \' \')"; done\n'
             'echo "current=$(readlink "$CURRENT")"')

    def command(self, builds_dir, current_link, archives_dir=""):
        return shell.script(self._BODY, BUILDS=builds_dir, CURRENT=current_link,
                            ARCHIVES=archives_dir)

    def process(self, output):
        builds: dict[str, dict] = {}
        current = None
        entry = None
        for line in output:
            if line.startswith("== "):
                entry = builds.setdefault(line[3:].strip(), {})
            elif line.startswith("current="):
                target = line.split("=", 1)[1].strip()
                current = target.rstrip("/").rsplit("/", 1)[-1] or None
            elif entry is not None and "=" in line:
                key, value = line.split("=", 1)
                entry[key] = sorted(set(value.split())) if key == "flags" else value.strip()
        return {"current": current, "builds": builds}

    @staticmethod
    def default():
        return {"current": None, "builds": {}}


class Libc(FactBase):
    """The host's C library and its version, which its binaries link against (a build key says
    it, llama_cpp/keys.py): "glibc 2.36", "musl 1.2.4"; None when the probe cannot tell
    (macOS and Termux have neither getconf's GNU_LIBC_VERSION nor a musl ldd)."""

    def command(self):
        return "getconf GNU_LIBC_VERSION 2>/dev/null || ldd --version 2>&1 | head -n 2"

    def process(self, output):
        lines = [line.strip() for line in output if line.strip()]
        if not lines:
            return None
        words = lines[0].split()
        if len(words) == 2 and words[0] == "glibc" and _VERSION.fullmatch(words[1]):
            return f"glibc {words[1]}"
        if words[:1] == ["musl"] and len(lines) > 1:
            version = lines[1].split()
            if len(version) == 2 and version[0] == "Version" and _VERSION.fullmatch(version[1]):
                return f"musl {version[1]}"
        return None


_VERSION = re.compile(r"[0-9]+(\.[0-9]+){1,3}")


class RemoteRef(FactBase):
    """Where `ref` points in `repo` now, by git ls-remote from the host.

    "<40 hex>": the commit; MISSING: the repository answered and has no such ref;
    None: unknown (no git on the host yet, or the repository did not answer).
    """

    MISSING = "missing"

    _BODY = ("command -v git >/dev/null || { echo nogit; exit 0; }\n"
             'out=$(GIT_TERMINAL_PROMPT=0 timeout 20 ' + shell.join(["git", *GIT_SAFE]) + ' ls-remote '
             '-- "$REPO" "$REF" "$REF^{}") || { echo unreachable; exit 0; }\n'
             'echo "$out"; echo answered')

    def command(self, repo, ref):
        return shell.script(self._BODY, REPO=repo, REF=ref)

    def process(self, output):
        if "answered" not in [line.strip() for line in output]:
            return None
        return pick_ls_remote(output) or self.MISSING


def pick_ls_remote(lines) -> str | None:
    """The commit of a ref from ls-remote output; a peeled tag (^{}) wins over the tag object."""
    best = None
    for line in lines:
        parts = line.split()
        if len(parts) != 2 or not COMMIT.fullmatch(parts[0]):
            continue
        if parts[1].endswith("^{}"):
            return parts[0]
        best = best or parts[0]
    return best


def ls_remote(repo: str, ref: str) -> str:
    """The command apply runs to resolve `ref` (the same query as RemoteRef, without timeouts)."""
    return shell.command("env", "GIT_TERMINAL_PROMPT=0", "git", *GIT_SAFE, "ls-remote", "--",
                         repo, ref, f"{ref}^{{}}")


class Stored(probe.Stored):
    """The clone, cmake trees, installed builds and `current` link under llama_cpp.prefix,
    with their sizes (for destroy).

    ```python
    {"/opt/meshdeploy/builds": 41943040, "/opt/meshdeploy/src/llama.cpp": 104857600}
    ```
    """


# --- GPUs and CPU, as far as a build's code depends on them ----------------------------------------
# Each says None where the host has no such tool, so a host that only compiles for others needs
# no GPU: its build's GPU code then comes from the cluster file (keys.gpu_code).

_CAP = re.compile(r"([1-9][0-9]?)\.([0-9])")
_GFX = re.compile(r"gfx[0-9a-f]{3,4}")


class CudaCompute(FactBase):
    """The compute capabilities of the host's NVIDIA GPUs, as CMAKE_CUDA_ARCHITECTURES spells
    them, each once in the driver's order.

    ```python
    ["86", "89"]
    ```
    None: no nvidia-smi, or it lists no GPU (no driver loaded, no device).
    """

    def command(self):
        return ("command -v nvidia-smi >/dev/null 2>&1 && "
                "nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null || true")

    def process(self, output):
        caps = [f"{m[1]}{m[2]}" for m in (_CAP.fullmatch(line.strip()) for line in output) if m]
        return list(dict.fromkeys(caps)) or None


class Hip(FactBase):
    """The HIP (ROCm) toolchain: its version (hipconfig --version), or where there is none yet
    the version apt would install (Debian's hipcc package follows ROCm's numbering), and the
    host's AMD GPU targets (rocm_agent_enumerator, the CPU agent gfx000 left out).

    ```python
    {"version": [5, 7] or None, "candidate": [5, 7] or None, "targets": ["gfx1030"]}
    ```
    None: no hipconfig and nothing apt would install.
    """

    def command(self):
        return ("if command -v hipconfig >/dev/null 2>&1; then "
                "echo \"version $(hipconfig --version 2>/dev/null)\"; "
                "rocm_agent_enumerator 2>/dev/null | sed 's/^/target /'; "
                "elif command -v apt-cache >/dev/null 2>&1; then "
                "apt-cache policy hipcc 2>/dev/null | sed -n 's/^ *Candidate: */candidate /p'; "
                "fi; true")

    def process(self, output):
        found = {"version": None, "candidate": None, "targets": []}
        seen = False
        for line in output:
            word, _, rest = line.strip().partition(" ")
            rest = rest.strip()
            if word in ("version", "candidate"):
                seen = seen or word == "version"
                found[word] = _major_minor(rest.split(":")[-1])
            elif word == "target" and _GFX.fullmatch(rest) and rest != "gfx000":
                found["targets"].append(rest)
        if not seen and found["candidate"] is None:
            return None
        found["targets"] = list(dict.fromkeys(found["targets"]))
        return found


def _major_minor(text: str) -> list[int] | None:
    numbers = [probe.uint(p) for p in re.split(r"[.~+-]", text)[:2]]
    return numbers if len(numbers) == 2 and None not in numbers else None


class CpuFlags(FactBase):
    """The CPU's instruction-set flags (/proc/cpuinfo's flags, or Features on ARM), as the first
    16 hex of the sha256 of their sorted set: hosts that report the same run the same
    -march=native code.

    None: no /proc/cpuinfo (macOS) or no flags line.
    """

    def command(self):
        return "grep -m 1 -E '^(flags|Features)[[:space:]]*:' /proc/cpuinfo 2>/dev/null || true"

    def process(self, output):
        line = next((o for o in output if ":" in o), None)
        if line is None:
            return None
        flags = sorted(set(line.split(":", 1)[1].split()))
        if not flags:
            return None
        return hashlib.sha256(" ".join(flags).encode("utf-8", "surrogateescape")).hexdigest()[:16]
