"""A bare llama.cpp git repository built from the trees vendored in llama-cpp-python sdists.

GitHub is out of reach in the lab, but every llama-cpp-python sdist on PyPI carries a full
llama.cpp tree under vendor/llama.cpp. Committing two of them in version order gives a real
history to pin, upgrade and roll back between. The commits are written with `git fast-import`
from the tarballs directly (no work tree, so no .gitattributes filters or umask can change the
blobs) with a fixed author and dates, which makes the commit ids the same on every machine.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from meshdeploy.lab.errors import LabError

REPO_NAME = "llama.cpp.git"
BRANCH = "master"
DEFAULT_VERSIONS = ("0.3.35", "0.3.36")
DEFAULT_CACHE = "/var/cache/meshdeploy/lab"
STAMP = "meshdeploy-mirror.json"
# Bumped whenever the way commits are written changes, so cached repositories get rebuilt.
FORMAT = 1

# Which upstream build each sdist vendors. 0.3.36: llama-cpp-python's CHANGELOG names
# 0c1e57098, reported by upstream as tag b11312. 0.3.35: its CHANGELOG names 4df29be4f as the
# last update of that release; public pins give the full id 4df29be4f4c3673f428170fda944a5b19f743bb8
# and the release tag b10454 (its ggml/CMakeLists.txt says ggml 0.20.0, matching those pins).
UPSTREAM = {
    "0.3.35": ("b10454", "4df29be4f4c3673f428170fda944a5b19f743bb8"),
    "0.3.36": ("b11312", "0c1e57098bba43ac29e6e3b677cdceebdd22334f"),
}

# Fixed identity and clock: commit ids depend on them. One day apart per commit keeps the
# history ordered for tools that sort by date.
AUTHOR = "meshdeploy lab <lab@meshdeploy.invalid>"
EPOCH = 1767225600  # 2026-01-01T00:00:00Z
DAY = 86400

_SDIST_RE = re.compile(r"^llama_cpp_python-(\d+(?:\.\d+)*)\.tar\.gz$")
_PROTO_RE = re.compile(r"#define\s+RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)")
_UPDATE_RE = re.compile(r"llama\.cpp@([0-9a-f]{7,40})")


def ensure_repo(dest_dir: Path, sdists: list[Path] | None = None) -> dict:
    """Build (or reuse) `dest_dir/llama.cpp.git`, one commit per sdist on `master`, tagged.

    + dest_dir: directory that holds the bare repository (created if missing)
    + sdists: llama-cpp-python sdist tarballs; default: 0.3.35 and 0.3.36 from
      $MESHDEPLOY_LAB_CACHE/sdist (downloaded from PyPI when missing)

    Returns {"path": Path, "tags": {tag: sha}, "head": sha, "commits": [...]}; each commit entry
    records the sdist version, upstream commit, tags and the RPC protocol version of its tree.
    """
    dest_dir = Path(dest_dir)
    paths = [Path(p) for p in sdists] if sdists is not None else default_sdists()
    if not paths:
        raise LabError("no llama-cpp-python sdist given: pass at least one tarball")
    inputs = sorted((_sdist_version(p), p) for p in paths)
    versions = [v for v, _ in inputs]
    if len(set(versions)) != len(versions):
        raise LabError(f"two sdists carry the same llama-cpp-python version: {versions}")
    key = {"format": FORMAT, "sdists": [_fingerprint(p) for _, p in inputs]}

    repo = dest_dir / REPO_NAME
    cached = _read_stamp(repo)
    if cached is not None and cached.get("key") == key:
        return _result(repo, cached)

    dest_dir.mkdir(parents=True, exist_ok=True)
    # Two callers at once (lab up and a test) must not both build and swap directories.
    with open(dest_dir / f".{REPO_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = _read_stamp(repo)
        if cached is not None and cached.get("key") == key:
            return _result(repo, cached)
        work = Path(tempfile.mkdtemp(prefix=".llama.cpp.git.", dir=dest_dir))
        try:
            commits = _build(work, [(v, p) for v, p in inputs])
            record = {"key": key, "commits": commits}
            (work / STAMP).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            _replace_dir(work, repo)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _result(repo, record)


def default_sdists(versions: tuple[str, ...] = DEFAULT_VERSIONS) -> list[Path]:
    """The sdists in the lab cache, downloading the missing ones from PyPI with pip."""
    cache = Path(os.environ.get("MESHDEPLOY_LAB_CACHE") or DEFAULT_CACHE) / "sdist"
    cache.mkdir(parents=True, exist_ok=True)
    found = []
    # Labs coming up at once in two processes: one downloads, the other waits for the whole
    # file (pip writes it under its final name as it goes).
    with open(cache / ".download.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for version in versions:
            path = cache / f"llama_cpp_python-{version}.tar.gz"
            if not path.exists():
                _download(version, cache)
            if not path.exists():
                raise LabError(
                    f"pip did not leave {path.name} in {cache}",
                    hint="download it by hand with pip download --no-deps --no-binary=:all: "
                    f"llama-cpp-python=={version} -d {cache}",
                )
            found.append(path)
    return found


def _download(version: str, dest: Path) -> None:
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
            f"llama-cpp-python=={version}", "-d", str(dest)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(
            f"downloading llama-cpp-python {version} from PyPI failed: "
            f"{proc.stderr.strip().splitlines()[-1:] or proc.returncode}",
            hint=f"copy llama_cpp_python-{version}.tar.gz into {dest} and retry",
        )


def _sdist_version(path: Path) -> tuple[tuple[int, ...], str]:
    match = _SDIST_RE.match(path.name)
    if not match:
        raise LabError(f"{path}: not a llama-cpp-python sdist name (llama_cpp_python-X.Y.Z.tar.gz)")
    if not path.is_file():
        raise LabError(f"{path}: no such file")
    version = match.group(1)
    return tuple(int(x) for x in version.split(".")), version


def _fingerprint(path: Path) -> list:
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


def _read_stamp(repo: Path) -> dict | None:
    try:
        record = json.loads((repo / STAMP).read_text())
    except (OSError, ValueError):
        return None
    # A stamp without the refs it names (a half-deleted repository) is not a cache hit.
    head = repo / "refs" / "heads" / BRANCH
    if not head.exists() and "refs/heads/" + BRANCH not in _packed_refs(repo):
        return None
    return record


def _packed_refs(repo: Path) -> str:
    try:
        return (repo / "packed-refs").read_text()
    except OSError:
        return ""


def _result(repo: Path, record: dict) -> dict:
    commits = record["commits"]
    tags = {tag: c["sha"] for c in commits for tag in c["tags"]}
    return {"path": repo, "tags": tags, "head": commits[-1]["sha"], "commits": commits}


def _build(repo: Path, inputs: list) -> list[dict]:
    _git(["init", "--quiet", "--bare", str(repo)])
    _git(["symbolic-ref", "HEAD", f"refs/heads/{BRANCH}"], repo)
    proc = subprocess.Popen(
        ["git", "fast-import", "--quiet", "--done"],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=_git_env(repo),
    )
    commits = []
    try:
        for n, ((_, version), path) in enumerate(inputs, start=1):
            commits.append(_write_commit(proc.stdin, n, version, path))
        proc.stdin.write(b"done\n")
        proc.stdin.close()
    except BrokenPipeError:
        pass
    err = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0:
        raise LabError(f"git fast-import failed: {err.strip()}")
    for entry in commits:
        # Every commit carries its llama-cpp-python-v<version> tag, so the tag names it.
        entry["sha"] = _git(["rev-parse", f"refs/tags/{entry['tags'][-1]}^{{commit}}"], repo)
    _git(["update-server-info"], repo)  # lets a plain HTTP server offer it too
    (repo / "git-daemon-export-ok").touch()  # git daemon serves it without --export-all too
    return commits


def _write_commit(out, n: int, version: str, sdist: Path) -> dict:
    """Stream one sdist's vendor/llama.cpp into fast-import as commit number n."""
    build_tag, upstream = UPSTREAM.get(version, (None, None))
    files, proto, changelog = [], None, b""
    # The file commands go to a spool first: the commit header must come before them, and the
    # RPC version and changelog it records are only known after reading the tarball.
    spool = tempfile.TemporaryFile()
    with tarfile.open(sdist, "r|gz") as tar:
        for member in tar:
            parts = member.name.split("/")
            if len(parts) == 2 and parts[1] == "CHANGELOG.md" and member.isfile():
                changelog = tar.extractfile(member).read()
            if len(parts) < 4 or parts[1:3] != ["vendor", "llama.cpp"] or ".git" in parts[3:]:
                continue
            rel = "/".join(parts[3:])
            if member.issym():
                data = member.linkname.encode()
                spool.write(f"M 120000 inline {_quote(rel)}\ndata {len(data)}\n".encode() + data + b"\n")
            elif member.isfile():
                mode = "100755" if member.mode & 0o111 else "100644"
                spool.write(f"M {mode} inline {_quote(rel)}\ndata {member.size}\n".encode())
                src = tar.extractfile(member)
                if rel == "ggml/include/ggml-rpc.h":
                    data = src.read()
                    proto = _rpc_proto(data)
                    spool.write(data)
                else:
                    shutil.copyfileobj(src, spool, 1 << 20)
                spool.write(b"\n")
            else:
                continue
            files.append(rel)
    if not files:
        raise LabError(f"{sdist}: no vendor/llama.cpp tree inside; is this a llama-cpp-python sdist?")
    if upstream is None:
        upstream = _changelog_upstream(changelog, version)
    tags = [t for t in (build_tag, f"llama-cpp-python-v{version}") if t]
    message = (
        f"llama.cpp {build_tag or upstream or 'unknown build'} "
        f"(vendored in llama-cpp-python {version})\n\n"
        f"Tree of vendor/llama.cpp from the PyPI sdist {sdist.name}, unchanged.\n\n"
        f"Upstream-Commit: {upstream or 'unknown'}\n"
        f"Upstream-Tag: {build_tag or 'unknown'}\n"
        f"Llama-Cpp-Python: {version}\n"
        f"RPC-Protocol: {proto or 'unknown'}\n"
    ).encode()
    when = EPOCH + (n - 1) * DAY
    out.write(f"commit refs/heads/{BRANCH}\nmark :{n}\n".encode())
    out.write(f"author {AUTHOR} {when} +0000\ncommitter {AUTHOR} {when} +0000\n".encode())
    out.write(f"data {len(message)}\n".encode() + message + b"\n")
    if n > 1:
        out.write(f"from :{n - 1}\n".encode())
    out.write(b"deleteall\n")
    spool.seek(0)
    shutil.copyfileobj(spool, out, 1 << 20)
    spool.close()
    out.write(b"\n")
    for tag in tags:
        out.write(f"reset refs/tags/{tag}\nfrom :{n}\n\n".encode())
    return {
        "version": version,
        "tags": tags,
        "upstream_commit": upstream,
        "rpc_protocol": proto,
        "files": len(files),
    }


def _rpc_proto(header: bytes) -> str | None:
    found = dict(_PROTO_RE.findall(header.decode(errors="replace")))
    if "MAJOR" not in found:
        return None
    return ".".join(found.get(k, "0") for k in ("MAJOR", "MINOR", "PATCH"))


def _changelog_upstream(changelog: bytes, version: str) -> str | None:
    """The first llama.cpp commit named in the sdist's own CHANGELOG section for its version."""
    text = changelog.decode(errors="replace")
    section = re.search(rf"^## \[{re.escape(version)}\](.*?)(?=^## \[|\Z)", text, re.M | re.S)
    match = _UPDATE_RE.search(section.group(1)) if section else None
    return match.group(1) if match else None


def _quote(path: str) -> str:
    # fast-import reads unquoted paths up to the end of line; C-style quoting covers the rest.
    if any(c in path for c in '"\\\n') or path.startswith('"'):
        return '"' + path.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return path


def _git_env(repo: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # Ignore the user's and system's git config: nothing there may change the objects written.
    env.update(GIT_DIR=str(repo), GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
               LC_ALL="C")
    return env


def _git(args: list[str], repo: Path | None = None) -> str:
    env = _git_env(repo) if repo is not None else None
    if shutil.which("git") is None:
        raise LabError("git is not installed", hint="apt-get install git")
    proc = subprocess.run(["git", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise LabError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def _replace_dir(new: Path, old: Path) -> None:
    """Put `new` at `old`; a reader never sees a half-built repository under the final name."""
    trash = None
    if old.exists():
        trash = old.with_name(old.name + f".old-{os.getpid()}")
        os.rename(old, trash)
    os.rename(new, old)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
