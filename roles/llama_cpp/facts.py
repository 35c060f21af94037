"""Facts of the llama_cpp role: the clone, the installed builds, where the ref points upstream."""

from __future__ import annotations

from pyinfra.api import FactBase


class Source(FactBase):
    """The clone at `path`: HEAD, origin URL, and whether `commit` is present.

    ```python
    {"head": "<40 hex>", "url": "https://...", "has_commit": True}
    ```
    None: no clone there.
    """

    def command(self, path, commit=None):
        has = (f"git -C {path} cat-file -e {commit}^{{commit}} 2>/dev/null && echo has || echo missing"
               if commit else "echo unknown")
        return (f"[ -d {path}/.git ] || exit 0; git -C {path} rev-parse HEAD; "
                f"git -C {path} remote get-url origin; {has}")

    def process(self, output):
        if len(output) < 3:
            return None
        return {"head": output[0].strip(), "url": output[1].strip(),
                "has_commit": {"has": True, "missing": False}.get(output[2].strip())}


class Builds(FactBase):
    """Installed builds under `builds_dir` and the `current` link.

    ```python
    {"current": "<key>" or None,
     "builds": {"<key>": {"commit": ..., "backend": ..., "rpc_binary": "ggml-rpc-server",
                          "targets": "llama-server ggml-rpc-server", "proto": "7.0.0",
                          "flags": ["--rpc", "-lm", ...]}}}
    ```
    """

    def command(self, builds_dir, current_link):
        return (f"for m in {builds_dir}/*/manifest; do [ -f \"$m\" ] || continue; "
                "d=${m%/manifest}; echo \"== ${d##*/}\"; cat \"$m\"; "
                "printf 'flags='; grep -oE -- '(^|[ ,])--?[a-zA-Z][a-zA-Z0-9-]*' \"$d/llama-server.help\" "
                "2>/dev/null | tr -d ' ,' | sort -u | tr '\\n' ' '; echo; done; "
                f"echo \"current=$(readlink {current_link})\"")

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
                entry[key] = value.split() if key == "flags" else value.strip()
        return {"current": current, "builds": builds}

    @staticmethod
    def default():
        return {"current": None, "builds": {}}


class RemoteRef(FactBase):
    """Where `ref` points in `repo` now, by git ls-remote from the host.

    "<40 hex>": the commit; MISSING: the repository answered and has no such ref;
    None: unknown (no git on the host yet, or the repository did not answer).
    """

    MISSING = "missing"

    def command(self, repo, ref):
        return ("command -v git >/dev/null || { echo nogit; exit 0; }; "
                f"out=$(GIT_TERMINAL_PROMPT=0 timeout 20 git ls-remote {repo} {ref} {ref}^{{}}) "
                "|| { echo unreachable; exit 0; }; echo \"$out\"; echo answered")

    def process(self, output):
        if "answered" not in [line.strip() for line in output]:
            return None
        return pick_ls_remote(output) or self.MISSING


def pick_ls_remote(lines) -> str | None:
    """The commit of a ref from ls-remote output; a peeled tag (^{}) wins over the tag object."""
    best = None
    for line in lines:
        parts = line.split()
        if len(parts) != 2 or len(parts[0]) != 40:
            continue
        if parts[1].endswith("^{}"):
            return parts[0]
        best = best or parts[0]
    return best
