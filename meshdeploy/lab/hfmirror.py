"""A Hugging Face Hub-compatible HTTP endpoint that serves model repositories from a directory.

Hosts in the lab cannot reach huggingface.co; pointing HF_ENDPOINT (or a cluster file's
huggingface.endpoint) here makes huggingface_hub, curl and the product's own downloads behave as
against the Hub: resolve URLs with X-Repo-Commit / X-Linked-Etag / X-Linked-Size, Range and
resume, the model-info and tree APIs with LFS sha256s, and the Hub's X-Error-Code errors.
Files are sent with sendfile (multi-GB GGUFs never pass through Python memory) and each is
hashed once: the sha256 is cached on disk, keyed by size and mtime.

Where the files lie (ROOT/models/<org>/<name>/refs/<branch>/...), their hashes and the
repositories' commit ids: lab/hfstore.py.

Access as on the Hub, for testing who sends a token: a repository named with --gated serves its
metadata to anyone but its files only with a token from --token-file (401 GatedRepo without one,
403 with another); one named with --private answers 401 RepoNotFound to everything without a
valid token. --verbose logs, per request, whether an Authorization header came (never its value).

A slow internet, for benchmarks: --rate BYTES_PER_SECOND caps the mirror's total sending of file
bodies, across all connections together (one shared token bucket), as one home uplink shared by
every host would; bodies then go out in 256 KiB sendfile chunks, each paid for before it is sent.
Metadata (API answers, headers, errors) is not limited. Without --rate nothing is paced.

Why not olah (the PyPI Hub mirror): offline it serves a local git-lfs repo and hf_hub_download
works, but it ignores Range (no resume), gives no size or sha256 in model_info(files_metadata=
True), reads a whole file into memory per request and re-hashes it on every HEAD; none of that
holds up with multi-GB GGUFs.

    python -m meshdeploy.lab.hfmirror --root DIR --bind ADDR --port PORT [--gemma]
        [--token-file FILE --gated ORG/NAME ... --private ORG/NAME ...] [--rate BYTES_PER_SECOND]
"""

from __future__ import annotations

import argparse
import datetime
import email.utils
import hashlib
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from meshdeploy.lab.errors import LabError
from meshdeploy.lab.hfstore import GEMMA_REPO, Store, ensure_gemma_repo, repo_dir

_SEND_CHUNK = 256 * 1024  # bytes per sendfile call when --rate paces the bodies


class TokenBucket:
    """One sending rate shared by every thread: `take(n)` returns once `n` bytes may go out.

    Tokens (bytes) accrue at `rate` per second up to `burst`. A taker reserves its bytes at once,
    possibly driving the balance below zero, then sleeps (outside the lock) until that debt is
    repaid; so concurrent takers queue behind each other and their sum never beats `rate`.
    """

    def __init__(self, rate: float, burst: int = _SEND_CHUNK):
        if not rate > 0:
            raise LabError(f"the rate must be a positive number of bytes per second, got {rate}")
        self.rate = float(rate)
        self.burst = float(burst)
        self._tokens = float(burst)
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """(start, end inclusive) of a single byte range; None = whole file; "unsatisfiable"."""
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None  # RFC 9110 lets a server ignore ranges it does not support
    first, dash, last = spec.strip().partition("-")
    if not dash or not (first.isdigit() or last.isdigit()):
        return None
    if not first:  # suffix: the last N bytes
        n = int(last)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(size - n, 0), size - 1
    start = int(first)
    end = int(last) if last.isdigit() else size - 1
    if last.isdigit() and end < start:
        return None  # invalid syntax: ignored, as RFC 9110 says
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size - 1)


class MirrorHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "meshdeploy-hfmirror"
    store: Store  # set by make_server
    access: dict = {}  # repo id -> "gated" | "private"; set by make_server
    tokens: frozenset = frozenset()  # bearer tokens that may read gated and private repos
    bucket: TokenBucket | None = None  # --rate: one limit on all bodies; set by make_server

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def _dispatch(self, head: bool) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        try:
            if len(parts) >= 5 and parts[2] == "resolve":
                self._check_access(f"{parts[0]}/{parts[1]}", files=True)
                self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head)
            elif len(parts) >= 4 and parts[:2] == ["api", "models"]:
                self._check_access(f"{parts[2]}/{parts[3]}", files=False)
                self._api(f"{parts[2]}/{parts[3]}", parts[4:], parse_qs(url.query), head)
            else:
                raise HubError(404, None, f"no such endpoint: {url.path}")
        except HubError as err:
            self._error(err, head)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-body

    def _check_access(self, repo_id: str, files: bool) -> None:
        """The Hub's answers to a client without a (valid) token: a gated repo's metadata is
        public, its files are not; a private repo does not exist for such a client."""
        mode = self.access.get(repo_id)
        if mode is None:
            return
        scheme, _, value = (self.headers.get("Authorization") or "").partition(" ")
        sent = scheme.lower() == "bearer" and bool(value.strip())
        if sent and value.strip() in self.tokens:
            return
        if mode == "private":
            raise HubError(401, "RepoNotFound", f"Repository {repo_id} not found")
        if files:
            raise HubError(403 if sent else 401, "GatedRepo",
                           f"Access to model {repo_id} is restricted. You must have access to it "
                           "and be authenticated to access it. Please log in.")

    def _lookup(self, repo_id: str, revision: str) -> tuple[str, str, dict]:
        try:
            exists = repo_dir(self.store.root, repo_id).is_dir()
        except LabError:
            exists = False
        if not exists:
            raise HubError(404, "RepoNotFound", f"Repository {repo_id} not found")
        found = self.store.resolve(repo_id, revision)
        if found is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return found

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        branch, commit, files = self._lookup(repo_id, revision)
        info = files.get(path)
        if info is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on \"{revision}\"", commit)
        full = repo_dir(self.store.root, repo_id) / "refs" / branch / path
        size = info["size"]
        etag = f'"{info["sha256"] if info["lfs"] else info["blob_id"]}"'
        rng = parse_range(self.headers.get("Range"), size)
        if rng == "unsatisfiable":
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end = rng if rng else (0, size - 1)
        self.send_response(206 if rng else 200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", etag)
        if info["lfs"]:
            self.send_header("X-Linked-Etag", etag)
            self.send_header("X-Linked-Size", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Disposition", f'attachment; filename="{Path(path).name}"')
        self.send_header("Last-Modified", email.utils.formatdate(info["mtime"], usegmt=True))
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        if not head and end >= start:
            with open(full, "rb") as f:
                self.send_body(f, start, end - start + 1)

    def send_body(self, f, offset: int, count: int) -> None:
        """Copy `count` bytes from `offset` of `f` to the client, in the kernel when possible;
        with a rate (make_server's `rate`), in chunks paced by the mirror's one token bucket."""
        self.wfile.flush()
        if self.bucket is None:
            self.connection.sendfile(f, offset, count)
            return
        while count > 0:
            n = min(count, _SEND_CHUNK)
            self.bucket.take(n)
            self.connection.sendfile(f, offset, n)
            offset += n
            count -= n

    def _api(self, repo_id: str, rest: list[str], query: dict, head: bool) -> None:
        if not rest:
            revision, kind, sub = "main", "info", ""
        elif rest[0] == "revision" and len(rest) == 2:
            revision, kind, sub = rest[1], "info", ""
        elif rest[0] == "tree" and len(rest) >= 2:
            revision, kind, sub = rest[1], "tree", "/".join(rest[2:]).strip("/")
        else:
            raise HubError(404, None, f"no such endpoint: /api/models/{repo_id}/{'/'.join(rest)}")
        branch, commit, files = self._lookup(repo_id, revision)
        if kind == "info":
            body = self._model_info(repo_id, commit, files, _flag(query, "blobs"))
            mode = self.access.get(repo_id)
            body.update(gated="manual" if mode == "gated" else False, private=mode == "private")
        else:
            body = self._tree(files, sub, _flag(query, "recursive"), commit, revision)
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    @staticmethod
    def _model_info(repo_id: str, commit: str, files: dict, blobs: bool) -> dict:
        siblings = []
        for path, info in files.items():
            entry = {"rfilename": path}
            if blobs:
                entry.update(size=info["size"], blobId=info["blob_id"])
                if info["lfs"]:
                    entry["lfs"] = {"sha256": info["sha256"], "size": info["size"],
                                    "pointerSize": info["pointer_size"]}
            siblings.append(entry)
        mtime = max((i["mtime"] for i in files.values()), default=0)
        return {
            "_id": commit[:24], "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
            "sha": commit, "lastModified": _iso(mtime), "private": False, "disabled": False,
            "gated": False, "downloads": 0, "likes": 0,
            "tags": ["gguf"] if any(p.endswith(".gguf") for p in files) else [],
            "siblings": siblings,
        }

    @staticmethod
    def _tree(files: dict, sub: str, recursive: bool, commit: str, revision: str) -> list[dict]:
        prefix = f"{sub}/" if sub else ""
        if sub and sub not in files and not any(p.startswith(prefix) for p in files):
            raise HubError(404, "EntryNotFound", f"{sub} does not exist on \"{revision}\"", commit)
        entries, dirs = [], {}
        for path, info in files.items():
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):].split("/")
            # Directories on the way to a file are listed too, as the Hub does.
            for depth in range(1, len(rest) if recursive else min(len(rest), 2)):
                d = prefix + "/".join(rest[:depth])
                dirs.setdefault(d, hashlib.sha1()).update(f"{path}\0{info['sha256']}\n".encode())
            if len(rest) > 1 and not recursive:
                continue
            entry = {"type": "file", "oid": info["blob_id"], "size": info["size"], "path": path}
            if info["lfs"]:
                entry["lfs"] = {"oid": info["sha256"], "size": info["size"],
                                "pointerSize": info["pointer_size"]}
            entries.append(entry)
        entries += [{"type": "directory", "oid": h.hexdigest(), "size": 0, "path": d}
                    for d, h in dirs.items()]
        return sorted(entries, key=lambda e: e["path"])

    def _error(self, err: HubError, head: bool) -> None:
        data = json.dumps({"error": err.message}).encode()
        self.send_response(err.status)
        if err.code:
            self.send_header("X-Error-Code", err.code)
        self.send_header("X-Error-Message", err.message)
        if err.commit:
            self.send_header("X-Repo-Commit", err.commit)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        if self.server.verbose:
            # The Range header shows in the log whether a download resumed.
            ranged = getattr(self, "headers", None) and self.headers.get("Range")
            suffix = f" range={ranged}" if ranged else ""
            # Whether a token came, never the token: tests read this log.
            if getattr(self, "headers", None) is not None:
                suffix += " auth=bearer" if self.headers.get("Authorization") else " auth=none"
            sys.stderr.write(f"{self.address_string()} {format % args}{suffix}\n")
            sys.stderr.flush()


def _flag(query: dict, name: str) -> bool:
    return query.get(name, ["false"])[-1].lower() in ("1", "true", "yes")


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def make_server(root: Path, bind: str = "127.0.0.1", port: int = 0, *,
                handler: type[MirrorHandler] = MirrorHandler, verbose: bool = False,
                access: dict | None = None, tokens=(),
                rate: float | None = None) -> ThreadingHTTPServer:
    """A threaded mirror server (not yet serving: call serve_forever, e.g. in a thread).

    + access: repo id -> "gated" or "private" (see the module's docstring); others are public
    + tokens: the bearer tokens that may read those
    + rate: bytes per second for all file bodies together (one token bucket); None = unlimited
    """
    if any(mode not in ("gated", "private") for mode in (access or {}).values()):
        raise LabError(f"access modes are gated or private, got {access}")
    bucket = TokenBucket(rate) if rate is not None else None
    handler_class = type("BoundMirrorHandler", (handler,), {
        "store": Store(Path(root)), "access": dict(access or {}),
        "tokens": frozenset(t for t in tokens if t), "bucket": bucket})
    server = ThreadingHTTPServer((bind, port), handler_class)
    server.daemon_threads = True
    server.verbose = verbose
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshdeploy.lab.hfmirror",
                                     description="Serve model repositories like the Hugging Face Hub.")
    parser.add_argument("--root", required=True, type=Path, help="served tree (ROOT/models/org/name/refs/branch/...)")
    parser.add_argument("--bind", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (0 = any free port; default 8080)")
    parser.add_argument("--gemma", action="store_true", help=f"lay out {GEMMA_REPO} before serving")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    parser.add_argument("--token-file", type=Path,
                        help="bearer tokens (one a line) that may read --gated/--private repos")
    parser.add_argument("--gated", action="append", default=[], metavar="ORG/NAME",
                        help="files only with a token, metadata to anyone (repeatable)")
    parser.add_argument("--private", action="append", default=[], metavar="ORG/NAME",
                        help="nothing without a token (repeatable)")
    parser.add_argument("--rate", type=float, metavar="BYTES_PER_SECOND",
                        help="cap the sending of file bodies, all connections together "
                             "(e.g. 12.5e6 for 100 Mbit/s); default: unlimited")
    args = parser.parse_args(argv)
    try:
        args.root.mkdir(parents=True, exist_ok=True)
        if args.gemma:
            ensure_gemma_repo(args.root)
        tokens = args.token_file.read_text().split() if args.token_file else []
        if (args.gated or args.private) and not tokens:
            raise LabError("--gated/--private need --token-file with at least one token")
        access = {**{r: "gated" for r in args.gated}, **{r: "private" for r in args.private}}
        server = make_server(args.root, args.bind, args.port, verbose=args.verbose,
                             access=access, tokens=tokens, rate=args.rate)
    except (LabError, OSError) as exc:
        print(f"hfmirror: {exc}", file=sys.stderr)
        return 1
    host, port = server.server_address[:2]
    # One parseable line, so whoever starts the mirror knows the port when --port 0 was asked.
    print(f"serving {args.root} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
