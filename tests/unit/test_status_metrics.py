"""`status` reads each llama-server's generation rate from its /metrics: the host script runs
for real (sh, curl, sed) against a loopback HTTP server that answers as llama-server does,
refusing /metrics without the API key when one is set; the key travels on curl's standard
input, never in an argument."""

from __future__ import annotations

import dataclasses
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshdeploy.commands import status
from meshdeploy.core.loading import load_cluster
from meshdeploy.roles.services.argv import llama_server_argv
from meshdeploy.views import status as view

ROOT = Path(__file__).resolve().parents[2]
METRICS = """# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 512
# HELP llamacpp:tokens_predicted_seconds_total Total time spent generating tokens
# TYPE llamacpp:tokens_predicted_seconds_total counter
llamacpp:tokens_predicted_seconds_total 16
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 0
"""
KEY = "s3cret-key"


@pytest.fixture
def server():
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            if self.path == "/health":
                body, code = b'{"status":"ok"}', 200
            elif self.headers.get("Authorization") != f"Bearer {KEY}":
                body, code = b'{"error":"Invalid API Key"}', 401
            elif self.path == "/metrics":
                body, code = METRICS.encode(), 200
            else:
                body, code = b'{"data":[{"id":"gemma"}]}', 200
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1], seen
    httpd.shutdown()


def cgroup(pid: int) -> str:
    """A process's cgroup as the host script reads it: the first 0:: or name=systemd line."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return next(line.split(":", 2)[2] for line in lines
                if line.startswith("0::") or ":name=systemd:" in line)


def lab_with(tmp_path, port: int, key_file: Path | None):
    text = (ROOT / "inventories" / "lab.yaml").read_text().replace("    port: 8080\n",
                                                                  f"    port: {port}\n")
    if key_file is not None:
        text = text.replace("    ctx_size: 2048\n",
                            f"    ctx_size: 2048\n    api_key_file: {key_file}\n")
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    return load_cluster(path)


def stubs(tmp_path, unit_cgroup: str | None = None, **tools) -> dict:
    """PATH with a systemctl that says every unit is active and that the server's unit runs in
    `unit_cgroup` (by default this process's: the loopback server below is the unit's own)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    unit_cgroup = cgroup(os.getpid()) if unit_cgroup is None else unit_cgroup
    tools.setdefault("systemctl", f'case "$*" in *show*) echo \'{unit_cgroup}\' ;; '
                                  '*) echo active ;; esac\n')
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def probe(tmp_path, port: int, key_file: Path | None, window: int = 0,
          unit_cgroup: str | None = None, cluster=None, host: str = "node1",
          **tools) -> list[str]:
    cluster = cluster or lab_with(tmp_path, port, key_file)
    env = stubs(tmp_path, unit_cgroup, **tools)
    script = status.host_script(cluster, cluster.host(host), window=window)
    done = subprocess.run(["sh", "-c", script],
                          capture_output=True, text=True, env=env, timeout=60)
    return done.stdout.splitlines()


def test_the_rate_comes_from_metrics_with_the_key_on_stdin(server, tmp_path):
    port, seen = server
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    lines = probe(tmp_path, port, key_file)
    (line,) = [line for line in lines if line.startswith("metrics ")]
    assert status.generation(line.split(" ", 2)[2]) == {"gen_tps": 32.0, "generated": 512}
    assert ("/metrics", f"Bearer {KEY}") in seen
    # /v1/models needs the key as much: the model's name comes with it.
    (models,) = [line for line in lines if line.startswith("models ")]
    assert models == 'models main {"data":[{"id":"gemma"}]}', lines
    assert ("/health", None) in seen  # /health never needs it


def test_without_the_key_there_is_no_rate_and_no_error(server, tmp_path):
    port, seen = server
    unreadable = tmp_path / "nowhere" / "api-key"
    lines = probe(tmp_path, port, unreadable)
    (line,) = [line for line in lines if line.startswith("metrics ")]
    assert status.generation(line.split(" ", 2)[2]) == {"gen_tps": None, "generated": None}
    assert ("/metrics", None) in seen  # asked, refused: 401


def test_the_key_is_never_an_argument(tmp_path):
    """What `ps` could show: the script's text passes the key file's path only."""
    text = (ROOT / "inventories" / "lab.yaml").read_text().replace(
        "    ctx_size: 2048\n", "    ctx_size: 2048\n    api_key_file: /etc/key\n")
    (tmp_path / "lab.yaml").write_text(text)
    cluster = load_cluster(tmp_path / "lab.yaml")
    script = status.host_script(cluster, cluster.host("node1"))
    assert "-H @-" in script and "Bearer" in script and "/etc/key" in script


def test_nothing_generated_yet_is_no_rate():
    assert status.generation("tokens_predicted_total=0 tokens_predicted_seconds_total=0") == \
        {"gen_tps": None, "generated": 0}


def test_the_text_view_shows_the_rate_and_its_tokens():
    rows = [{"host": "node1", "service": "llama-server main", "unit": "active",
             "answer": "healthy", "protocol": "3.0.0", "model": "gemma", "gen_tps": 32.0,
             "generated": 512, "healthy": True}]
    text = view.render_text(rows)
    assert text.splitlines()[0].split() == ["host", "service", "unit", "answer", "protocol",
                                            "model", "gen", "t/s", "healthy"]
    assert "32.00 since start (512 tokens)" in text


def test_the_text_view_shows_the_recent_rate_not_the_mean_since_start():
    row = {"host": "node1", "service": "llama-server main", "unit": "active",
           "answer": "healthy", "protocol": "3.0.0", "model": "gemma", "gen_tps": 32.0,
           "generated": 512, "recent_tps": 8.0, "recent_generated": 64, "window": 5,
           "healthy": True}
    text = view.render_text([row])
    assert "8.00 (64 tokens in 5 s)" in text and "32.00" not in text
    idle = view.render_text([{**row, "recent_tps": None, "recent_generated": 0}])
    assert "no completion ended in 5 s" in idle and "32.00" not in idle


def test_the_recent_rate_is_that_of_the_tokens_between_two_samples():
    first = "tokens_predicted_total=512 tokens_predicted_seconds_total=16"
    second = "tokens_predicted_total=576 tokens_predicted_seconds_total=24"
    # 64 tokens in 8 s of generating: 8 tok/s, where the mean since start says 32.
    assert status.recent(first, second, 5) == {"recent_tps": 8.0, "recent_generated": 64,
                                               "window": 5}
    assert status.recent(first, first, 5) == {"recent_tps": None, "recent_generated": 0,
                                              "window": 5}
    # A restarted server (counters went down) or a sample without counters: no figure.
    restarted = "tokens_predicted_total=10 tokens_predicted_seconds_total=1"
    for later in (restarted, ""):
        assert status.recent(first, later, 5)["recent_generated"] is None


def test_the_host_script_reads_the_counters_again_after_the_window(server, tmp_path):
    port, seen = server
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    lines = probe(tmp_path, port, key_file, window=1)
    again = [line for line in lines if line.startswith(f"{status.METRICS_AGAIN} ")]
    assert again == ["metrics-again main tokens_predicted_total=512 "
                     "tokens_predicted_seconds_total=16 "], lines
    assert [p for p, _ in seen].count("/metrics") == 2
    assert lines.index(again[0]) > max(i for i, line in enumerate(lines)
                                       if line.startswith("metrics "))


def test_llama_server_serves_metrics_once():
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    argv = llama_server_argv("/opt/llama-server", cluster, cluster.servers[0], "/m.gguf")
    assert argv.count("--metrics") == 1
    older = llama_server_argv("/opt/llama-server", cluster, cluster.servers[0], "/m.gguf",
                              flags=frozenset({"-m", "--host", "--port", "--rpc", "-ngl", "-c"}))
    assert "--metrics" not in older


@pytest.mark.parametrize("window", ["x", "-1", "301"])
def test_a_window_that_is_not_whole_seconds_is_a_usage_error(window):
    from support.cli import meshdeploy

    done = meshdeploy("status", ROOT / "inventories" / "lab.yaml", "--window", window)
    assert done.returncode == 1 and "usage: meshdeploy status" in done.stderr
    assert f"expected whole seconds from 0 to 300, got '{window}'" in done.stderr


# -- the API key goes only to the unit's own listener ---------------------------------------------
# While the server is down its port is anyone's to take: a local user's process that binds it
# would get the key with status's /v1/models and /metrics requests. The host script sends it
# only when every listener on the port is the server's unit (md_owner: its cgroup, or for runit
# its process tree).

SQUATTER = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(sys.argv[1], "a") as f:
            f.write("%s %s\n" % (self.path, self.headers.get("Authorization")))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status": "ok", "data": [{"id": "squat"}]}')
    def log_message(self, *args):
        pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""
UNIT_CGROUP = "/system.slice/meshdeploy-server-main.service"


@pytest.fixture
def squatter(tmp_path):
    """A process of its own listening on a free loopback port: (port, pid, what it was sent)."""
    log = tmp_path / "squatter.log"
    log.touch()
    proc = subprocess.Popen([sys.executable, "-c", SQUATTER, str(log)], stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(proc.stdout.readline())
        yield port, proc.pid, lambda: log.read_text().splitlines()
    finally:
        proc.kill()
        proc.wait()


def _key_file(tmp_path) -> Path:
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    return key_file


def test_a_process_outside_the_units_cgroup_on_the_port_never_gets_the_key(squatter, tmp_path):
    port, pid, seen = squatter
    assert cgroup(pid) != UNIT_CGROUP
    lines = probe(tmp_path, port, _key_file(tmp_path), window=1, unit_cgroup=UNIT_CGROUP)
    assert seen(), "the squatter was not asked at all"
    assert [line for line in seen() if KEY in line] == []
    assert all(line.endswith(" None") for line in seen()), seen()
    assert f"keyless main {UNIT_CGROUP}\tforeign {cgroup(pid)}" in lines


def test_a_listener_in_the_units_cgroup_gets_the_key(squatter, tmp_path):
    port, pid, seen = squatter
    lines = probe(tmp_path, port, _key_file(tmp_path), unit_cgroup=cgroup(pid))
    assert ("/metrics Bearer " + KEY) in seen() and ("/v1/models Bearer " + KEY) in seen()
    assert "/health None" in seen()
    assert not [line for line in lines if line.startswith("keyless")]


def test_without_a_key_file_nothing_is_checked(squatter, tmp_path):
    port, _, seen = squatter
    lines = probe(tmp_path, port, None, unit_cgroup=UNIT_CGROUP,
                  ss="echo ss-ran >&2; exit 1\n")
    assert "/metrics None" in seen()
    assert not [line for line in lines if line.startswith("keyless")]


class _Session:
    """status.collect's session: node1's script runs here."""

    def __init__(self, cluster, env):
        self.cluster, self.env = cluster, env

    def hosts(self):
        return [self.cluster.host("node1")]

    def run(self, name, script, sudo):
        done = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                              env=self.env, timeout=60)
        return done.returncode == 0, SimpleNamespace(stdout_lines=done.stdout.splitlines())


def test_the_row_says_why_no_key_was_sent(squatter, tmp_path):
    port, pid, _ = squatter
    cluster = lab_with(tmp_path, port, _key_file(tmp_path))
    rows = status.collect(_Session(cluster, stubs(tmp_path, UNIT_CGROUP)))
    (row,) = [r for r in rows if r["service"] == "llama-server main"]
    why = (f"it is held by cgroup {cgroup(pid)}, not by meshdeploy-server-main "
           f"({UNIT_CGROUP}): another process took the port")
    assert row["key_withheld"] == why and row["healthy"] is False
    assert f"healthy; API key not sent: {why}" in view.render_text([row])


@pytest.mark.parametrize("manager", ["systemd-user", "runit"])
def test_a_rootless_server_sends_the_key_only_to_its_own_process_tree(manager, squatter,
                                                                     tmp_path):
    """systemd --user: the user manager's cgroup of the unit; runit: the listener is the
    service's process (sv status's pid) or a descendant of it (here the squatter is a child of
    this test's process, a sleeping sibling is not its parent)."""
    from test_services_rootless import rootless_lab

    port, pid, seen = squatter
    base = rootless_lab(manager, hosts=("node1",))
    (server,) = [s for s in base.servers if s.host == "node1"]
    server = dataclasses.replace(server, port=port, api_key_file=str(_key_file(tmp_path)))
    cluster = dataclasses.replace(base, servers=(server,))
    sibling = subprocess.Popen(["sleep", "60"])
    try:
        for owner, gets in [(os.getpid(), True), (sibling.pid, False), (pid, True)]:
            if manager == "systemd-user":  # the user manager says the unit's cgroup
                owner_cgroup = cgroup(owner) if gets else UNIT_CGROUP
                tools = {"systemctl": f'case "$*" in "--user show"*) echo \'{owner_cgroup}\' ;; '
                                      '*) echo active ;; esac\n'}
            else:
                tools = {"sv": f'echo "run: $2: (pid {owner}) 5s; run: log: (pid 1) 5s"\n'}
            before = len(seen())
            lines = probe(tmp_path, port, None, cluster=cluster, **tools)
            sent = [line for line in seen()[before:] if KEY in line]
            assert bool(sent) == gets, (owner, lines, seen())
            assert any(line.startswith("keyless main") for line in lines) == (not gets), lines
    finally:
        sibling.kill()
        sibling.wait()
