"""`status` reads each llama-server's generation rate from its /metrics: the host script runs
for real (sh, curl, sed) against a loopback HTTP server that answers as llama-server does,
refusing /metrics without the API key when one is set; the key travels on curl's standard
input, never in an argument."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from pathlib import Path

import pytest

from meshdeploy.commands import status
from meshdeploy.config.load import load_cluster
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


def probe(tmp_path, port: int, key_file: Path | None, window: int = 0) -> list[str]:
    text = (ROOT / "inventories" / "lab.yaml").read_text().replace("    port: 8080\n",
                                                                  f"    port: {port}\n")
    if key_file is not None:
        text = text.replace("    ctx_size: 2048\n",
                            f"    ctx_size: 2048\n    api_key_file: {key_file}\n")
    path = tmp_path / "lab.yaml"
    path.write_text(text)
    cluster = load_cluster(path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "systemctl").write_text("#!/bin/sh\necho active\n")
    (bin_dir / "systemctl").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    script = status.host_script(cluster, cluster.host("node1"), window=window)
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
