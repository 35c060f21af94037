"""Live progress: the remote scripts' progress lines, produced here for real (a ninja build of a
tiny CMake project through the role's own build.sh, curl downloading from a loopback mirror
slowed on the server's side, the /health loop against a server that answers 503 first), parsed into
events, and the views that show them (rich on a terminal, throttled plain lines in a pipe)."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.gittree import commit_all

from meshdeploy.core import progress, shell
from meshdeploy.core.progress import MARKER, Event, Meter, Reporter, parse, parse_ninja
from meshdeploy.lab import hfmirror, hfstore
from meshdeploy.roles.llama_cpp.operations import TEMPLATES
from meshdeploy.roles.models import operations as models
from meshdeploy.roles.services.orchestrator import health_wait
from meshdeploy.views.progress import LiveView, PlainView, describe, view_for


def marked(stdout: str) -> list[Event]:
    events = [parse(line) for line in stdout.splitlines() if line.startswith(MARKER)]
    assert None not in events, stdout
    return events


def increasing(values: list[int]) -> bool:
    return all(a < b for a, b in zip(values, values[1:]))


# ---- the build: ninja's [n/m] --------------------------------------------------------------

def test_real_ninja_status_lines_parse(tmp_path):
    """ninja writing to a pipe prints one `[done/total] description` line per edge."""
    edges = "\n".join(f"build out{i}: touch\n" for i in range(7))
    (tmp_path / "build.ninja").write_text("rule touch\n  command = touch $out\n"
                                          "  description = TOUCH $out\n" + edges)
    out = subprocess.run(["ninja", "-j1"], cwd=tmp_path, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "NINJA_STATUS": "[%f/%t] "}, check=True)
    events = [e for e in map(parse_ninja, out.stdout.splitlines()) if e is not None]
    assert [e.done for e in events] == list(range(1, 8)) and {e.total for e in events} == {7}
    assert events[0].note.startswith("TOUCH out")
    assert parse_ninja("ninja: no work to do.") is None
    assert parse_ninja("[9/7] impossible") is None


def _tiny_tree(root: Path) -> str:
    """A git tree shaped like llama.cpp's as build.sh reads it: two C targets, the RPC worker's
    CMakeLists naming its target, ggml-rpc.h with the protocol version."""
    (root / "tools" / "rpc").mkdir(parents=True)
    (root / "ggml" / "include").mkdir(parents=True)
    (root / "tools" / "rpc" / "CMakeLists.txt").write_text("set(TARGET ggml-rpc-server)\n")
    (root / "ggml" / "include" / "ggml-rpc.h").write_text(
        "#define RPC_PROTO_MAJOR_VERSION 7\n#define RPC_PROTO_MINOR_VERSION 0\n"
        "#define RPC_PROTO_PATCH_VERSION 0\n")
    parts = [f"p{i}.c" for i in range(10)]
    for i, name in enumerate(parts):
        (root / name).write_text(f"int part{i}(void) {{ return {i}; }}\n")
    (root / "main.c").write_text('#include <stdio.h>\nint main(void) { puts("usage"); return 0; }\n')
    (root / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\nproject(tiny C)\n"
        f"add_library(parts STATIC {' '.join(parts)})\n"
        "add_executable(llama-server main.c)\ntarget_link_libraries(llama-server parts)\n"
        "add_executable(ggml-rpc-server main.c)\n"
        "set_target_properties(llama-server ggml-rpc-server PROPERTIES "
        "RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n")
    return commit_all(root)


def test_build_script_reports_ninja_progress_while_it_builds(tmp_path):
    """The role's build.sh on a real CMake + ninja build (each compile slowed to 0.6 s by a
    compiler launcher): the watcher's lines carry ninja's [n/m], increasing, before the end."""
    commit = _tiny_tree(tmp_path / "src")
    slow = tmp_path / "slow-cc"
    slow.write_text('#!/bin/sh\nsleep 0.6\nexec "$@"\n')
    slow.chmod(0o755)
    script = shell.template(
        TEMPLATES / "build.sh", prelude=progress.SHELL,
        args=["-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_C_COMPILER_LAUNCHER={slow}"],
        SRC=tmp_path / "src", TREE=tmp_path / "tree", OUT=tmp_path / "builds" / "k",
        COMMIT=commit, NUMBER=1, JOBS=1, CCACHE="", WANT_SERVER=1, WANT_RPC=1,
        RPC_TARGETS="ggml-rpc-server rpc-server", KEY="k", BACKEND="cpu")
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "builds" / "k" / "bin" / "llama-server").exists()
    events = marked(done.stdout)
    builds = [e for e in events if e.kind == "build"]
    assert len(builds) >= 3, done.stdout
    assert increasing([e.done for e in builds]) and len({e.total for e in builds}) == 1
    assert builds[-1].done <= builds[-1].total
    phases = [e.note for e in events if e.kind == "phase"]
    assert phases == ["configure", "install"]
    assert events.index(builds[-1]) < len(events) - 1  # all of them before the install


def test_build_script_failure_still_fails_and_stops_its_watcher(tmp_path):
    commit = _tiny_tree(tmp_path / "src")
    (tmp_path / "src" / "p3.c").write_text("this is not C\n")
    subprocess.run(["git", "-C", str(tmp_path / "src"), "-c", "user.name=t", "-c",
                    "user.email=t@t", "commit", "-qam", "broken"], check=True)
    commit = subprocess.run(["git", "-C", str(tmp_path / "src"), "rev-parse", "HEAD"],
                            capture_output=True, text=True, check=True).stdout.strip()
    script = shell.template(
        TEMPLATES / "build.sh", prelude=progress.SHELL, args=["-DCMAKE_BUILD_TYPE=Release"],
        SRC=tmp_path / "src", TREE=tmp_path / "tree", OUT=tmp_path / "builds" / "k",
        COMMIT=commit, NUMBER=1, JOBS=1, CCACHE="", WANT_SERVER=1, WANT_RPC=1,
        RPC_TARGETS="ggml-rpc-server", KEY="k", BACKEND="cpu")
    # communicate() returns only once every holder of the pipe exited: the watcher too.
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "p3.c" in done.stderr
    assert not (tmp_path / "builds" / "k").exists()


def test_unwatch_leaves_no_process_behind():
    """md_unwatch ends the watcher and its sleep. A sleep left running keeps a transient unit's
    cgroup populated after its script exits: systemd then stops the unit (stop-sigterm) and
    waits for the cgroup to empty; on the lab it once never saw that and failed a seeding unit
    with result 'timeout' after 90 s (a lab host's systemd at log level debug: "running ->
    stop-sigterm -> dead" with the old watcher, "running -> dead" with this one). The script
    runs in a session of its own; once it has exited, no process of that session is left
    (/proc/PID/stat's sixth field is the session)."""
    script = progress.SHELL + "\nmd_watch :\nsleep 0.3\nmd_unwatch\n"
    for shell_name in ("sh", "bash"):
        proc = subprocess.Popen([shell_name, "-c", script], start_new_session=True)
        assert proc.wait(timeout=10) == 0
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                name, rest = stat.read_text().rsplit(")", 1)
            except OSError:
                continue
            if int(rest.split()[3]) == proc.pid:
                left.append(name.split("(", 1)[1])
        assert left == [], (shell_name, left)


# ---- downloads: bytes of the partial file ---------------------------------------------------

REPO, FILE = "acme/slow-GGUF", "slow.gguf"


class Slow(hfmirror.MirrorHandler):
    """Sends 64 KiB every 0.15 s (about 440 KB/s). curl's own --limit-rate would do, but the
    curl of Debian 12 (7.88.1) ignores it on loopback: measured here, 3 MB at 600k in 0.04 s."""

    def send_body(self, f, offset: int, count: int) -> None:
        f.seek(offset)
        while count > 0:
            chunk = f.read(min(count, 65536))
            self.wfile.write(chunk)
            self.wfile.flush()
            count -= len(chunk)
            time.sleep(0.15)


@pytest.fixture
def slow_mirror(tmp_path):
    """(url, bytes) of a 4 MiB file on a slow loopback mirror that honours Range (resume)."""
    data = hashlib.sha256(b"x").digest() * (4 * 2**20 // 32)
    source = tmp_path / FILE
    source.write_bytes(data)
    hfstore.add_file(tmp_path / "hub", REPO, FILE, source)
    server = hfmirror.make_server(tmp_path / "hub", handler=Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/{REPO}/resolve/main/{FILE}", data
    server.shutdown()
    server.server_close()


def test_download_reports_bytes_resumed_and_total_with_real_curl(tmp_path, slow_mirror):
    """Real curl resumes a 1 MiB partial of 4 MiB at about 440 KB/s: the lines give the
    growing byte count, the total, and the bytes that were already there."""
    url, data = slow_mirror
    target = tmp_path / "models" / FILE
    target.parent.mkdir()
    partial = Path(f"{target}{models.d.models_partial_suffix}")
    partial.write_bytes(data[:2**20])
    script = models.download_script(str(target), url, len(data), hashlib.sha256(data).hexdigest())
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == data and not partial.exists()
    events = marked(done.stdout)
    downloads = [e for e in events if e.kind == "download"]
    assert len(downloads) >= 2, done.stdout
    assert increasing([e.done for e in downloads])
    assert {(e.label, e.total, e.resumed) for e in downloads} == {(FILE, len(data), 2**20)}
    assert downloads[0].done > 2**20 and downloads[-1].done <= len(data)
    assert [e.note for e in events if e.kind == "phase"] == ["verify sha256"]


# ---- /health: 503 Loading model --------------------------------------------------------------

def test_health_wait_reports_each_attempt(tmp_path):
    """llama-server answers 503 while it loads: each attempt of the budget is one line."""
    answers = iter([503, 503, 503])

    class Loading(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(next(answers, 200))
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Loading)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        srv = SimpleNamespace(health=SimpleNamespace(retries=10, interval=0.1, budget=1),
                              local_url=f"http://127.0.0.1:{server.server_address[1]}",
                              unit_name="meshdeploy-server-main")
        done = subprocess.run(["sh", "-c", health_wait(srv, "true")], capture_output=True,
                              text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0, done.stderr
    events = marked(done.stdout)
    assert [(e.kind, e.done, e.total, e.note, e.label) for e in events] == [
        ("health", i, 10, "503", "meshdeploy-server-main") for i in (1, 2, 3)]


# ---- parsing, rates, the reporter ---------------------------------------------------------

def test_malformed_marked_lines_are_consumed_not_shown():
    r = Reporter(["a"])
    for junk in (f"{MARKER} build nonsense", f"{MARKER} download x y z", f"{MARKER}",
                 f"{MARKER} health 1 2"):
        assert parse(junk) is None
        assert r.line("a", junk) is True
    assert r.line("a", "an ordinary line") is False
    assert r.events == 0


def test_meter_rate_and_eta_from_samples():
    m = Meter()
    m.add(0.0, 0)
    assert m.rate() is None
    m.add(2.0, 20_000_000)
    m.add(4.0, 40_000_000)
    assert m.rate() == 10_000_000 and m.eta(100_000_000) == 6.0
    m.add(5.0, 1_000)  # started over: the old samples no longer count
    assert m.rate() is None


def reporter_at(clock: list[float], hosts=("node1", "node2")) -> Reporter:
    return Reporter(list(hosts), clock=lambda: clock[0])


def test_describe_build_download_seed_health():
    clock = [100.0]
    r = reporter_at(clock)
    r.begin("node1", "llama_cpp.build")
    r.line("node1", f"{MARKER} build [30/120] Building CXX object a.o")
    clock[0] = 110.0
    r.line("node1", f"{MARKER} build [45/120] Building CXX object b.o")
    h = r.snapshot()[0]
    assert describe(h, 110.0) == ("llama_cpp.build: [45/120] 38%, 90 steps/min, "
                                  "ETA 50 s (10 s)")
    r.begin("node2", "models.gguf[gemma]")
    r.line("node2", f"{MARKER} download 50000000 253113024 50000000 gemma.gguf")
    clock[0] = 114.0
    r.line("node2", f"{MARKER} download 90000000 253113024 50000000 gemma.gguf")
    text = describe(r.snapshot()[1], 114.0)
    assert text == ("models.gguf[gemma]: gemma.gguf 90.0 MB of 253.1 MB 36%, 10.0 MB/s, "
                    "ETA 16 s, resumed at 50.0 MB (4 s)")
    r.begin("node2", "rpc_cache.seed[50052]")
    r.line("node2", f"{MARKER} seed 1200000000 2160000000 m.gguf")
    assert describe(r.snapshot()[1], 114.0).startswith(
        "rpc_cache.seed[50052]: 1.20 GB of 2.16 GB hashed 56%")
    r.begin("node1", "services.llama_server[main]")
    r.line("node1", f"{MARKER} health 7 90 503 meshdeploy-server-main")
    assert describe(r.snapshot()[0], 114.0) == (
        "services.llama_server[main]: 503 Loading model, attempt 7 of 90 (0 s)")
    r.begin("node1", "toolchain.packages")
    assert describe(r.snapshot()[0], 180.0) == "toolchain.packages: running (1 min 06 s)"
    r.end("node1", "toolchain.packages")
    assert r.snapshot()[0].slot is None


def test_plain_view_throttles_per_host_and_never_goes_silent():
    """A line once a step has run 5 s, then at most one per 5 s when there is news, and one
    every 30 s when there is none."""
    clock = [0.0]
    r = reporter_at(clock)
    out = io.StringIO()
    view = PlainView(out, every=5.0, heartbeat=30.0)
    view.reporter = r

    def tick(t):
        clock[0] = t
        before = out.getvalue()
        view.refresh()
        return out.getvalue()[len(before):].splitlines()

    r.begin("node1", "llama_cpp.build")
    assert tick(1.0) == []  # short steps say nothing but their end
    r.line("node1", f"{MARKER} build [1/100] a")
    assert tick(5.0) == ["  node1        llama_cpp.build: [1/100] 1% (5 s)"]
    r.line("node1", f"{MARKER} build [2/100] b")
    assert tick(7.0) == []  # news, but the last line is 2 s old
    late = "llama_cpp.build: [2/100] 2%, 15 steps/min, ETA 6 min 32 s"
    assert tick(10.0) == [f"  node1        {late} (10 s)"]
    assert tick(20.0) == []  # no news
    assert tick(40.0) == [f"  node1        {late} (40 s)"]  # heartbeat
    r.begin("node2", "toolchain.packages")
    assert tick(46.0) == ["  node2        toolchain.packages: running (6 s)"]
    r.end("node1", "llama_cpp.build")
    r.end("node2", "toolchain.packages")
    assert tick(80.0) == []


def test_live_view_draws_a_line_per_host():
    from rich.console import Console

    clock = [0.0]
    r = reporter_at(clock)
    r.begin("node2", "llama_cpp.build")
    r.line("node2", f"{MARKER} build [12/48] x")
    console = Console(file=io.StringIO(), width=100)
    view = LiveView(console)
    view.reporter = r
    console.print(view.renderable(3.0))
    lines = [line.rstrip() for line in console.file.getvalue().splitlines()]
    assert [line for line in lines if "node" in line] == [
        "node1  waiting", "node2  llama_cpp.build: [12/48] 25% (3 s)"]


def test_views_by_output():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert view_for(True, Tty()) is None
    assert isinstance(view_for(False, io.StringIO()), PlainView)
    assert isinstance(view_for(False, Tty()), (LiveView, PlainView))  # TERM=dumb: plain


def test_tap_routes_marked_lines_and_keeps_the_rest():
    """The wrapped exec_command of a paramiko client: marked lines go to the listener while the
    command runs, every other line (and the channel) reaches pyinfra unchanged."""
    heard = []

    class Stdout:
        channel = "the channel"

        def __iter__(self):
            yield b"real output\n"
            yield f"{MARKER} build [1/2] x\n".encode()
            yield "more\n"

    class Client:
        def exec_command(self, command, get_pty=False):
            return "in", Stdout(), "err"

    client = Client()
    progress.tap(client, heard.append)
    progress.tap(client, heard.append)  # once only
    _, stdout, _ = client.exec_command("x")
    assert list(stdout) == [b"real output\n", "more\n"] and stdout.channel == "the channel"
    assert heard == [f"{MARKER} build [1/2] x"]


def test_apply_json_refuses_to_ask_for_confirmation(tmp_path):
    """stdout of --json is one document: no prompt can go there, so yes must be given first."""
    import sys

    lab = Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml"
    done = subprocess.run([sys.executable, "-m", "meshdeploy", "apply", str(lab), "--json"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    # The refusal is the one document on stdout: a JSON diagnostic, nothing on stderr.
    assert done.returncode == 1 and done.stderr == ""
    (error,) = json.loads(done.stdout)["diagnostics"]
    assert error["summary"] == "apply --json cannot ask for confirmation"
    assert "--auto-approve" in error["detail"]
