"""Run inside a fresh network namespace (`unshare -n`) by tests/unit/test_monitoring.py: the
services of a three-host cluster as Prometheus meets them, on addresses of the namespace's
loopback, then Debian's prometheus and prometheus-blackbox-exporter with the files `meshdeploy
prometheus` wrote into argv[1]. Prints one JSON line per observation.

- node1: llama-server's /metrics behind the key "k"; one completion of 64 tokens in 8 s of
  generating ends once Prometheus has sampled the counters twice;
- node2: an rpc-server in use: listen(1), as ggml-rpc listens, with one connection accepted and
  held (its llama-server's) and never another accepted;
- node3: an idle rpc-server that accepts and reads EOF, then stops;
- every host's SSH port: a listener that accepts.
"""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

OUT = sys.argv[1]
PROMETHEUS = "127.0.0.1:19090"
BLACKBOX = sys.argv[2]
completed = threading.Event()


class Metrics(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer k":
            self.send_response(401)
            self.end_headers()
            return
        tokens, seconds = (164, 18) if completed.is_set() else (100, 10)
        body = (f"llamacpp:tokens_predicted_total {tokens}\n"
                f"llamacpp:tokens_predicted_seconds_total {seconds}\n").encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def listener(address: str, port: int, backlog: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, port))
    s.listen(backlog)
    return s


def accept_forever(s: socket.socket) -> None:
    try:
        while True:
            conn, _ = s.accept()
            conn.recv(1)
            conn.close()
    except OSError:
        return  # closed: the service stopped


def query(expr: str) -> list:
    url = f"http://{PROMETHEUS}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return json.load(answer)["data"]["result"]
    except OSError:
        return []


def by_host(expr: str) -> dict:
    return {r["metric"].get("host", ""): float(r["value"][1]) for r in query(expr)}


def wait(name: str, expr: str, ok, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = by_host(expr)
        if ok(got):
            print(json.dumps({"name": name, "expr": expr, "value": got}), flush=True)
            return
        time.sleep(0.5)
    print(json.dumps({"name": name, "expr": expr, "value": by_host(expr), "timeout": True}),
          flush=True)


def main() -> None:
    for address in ("10.77.0.1", "10.77.0.11", "10.77.0.12", "10.77.0.13"):
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    server = http.server.ThreadingHTTPServer(("10.77.0.11", 8080), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for address in ("10.77.0.12", "10.77.0.13"):
        threading.Thread(target=accept_forever, args=(listener(address, 22, 16),),
                         daemon=True).start()
    busy = listener("10.77.0.12", 50052, 1)
    held = socket.create_connection(("10.77.0.12", 50052))  # kept open to the end
    busy.accept()
    idle = listener("10.77.0.13", 50052, 1)
    threading.Thread(target=accept_forever, args=(idle,), daemon=True).start()
    procs = [subprocess.Popen(["prometheus-blackbox-exporter",
                               f"--config.file={OUT}/blackbox.yml",
                               f"--web.listen-address={BLACKBOX}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
             subprocess.Popen(["prometheus", f"--config.file={OUT}/prometheus.yml",
                               f"--storage.tsdb.path={OUT}/data",
                               f"--web.listen-address={PROMETHEUS}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        wait("busy", 'probe_success{job="meshdeploy-rpc-server"} == 0',
             lambda got: "node2" in got)
        wait("busy duration", 'probe_duration_seconds{job="meshdeploy-rpc-server",host="node2"}',
             lambda got: got.get("node2", 0) >= 1)
        wait("up while busy", "meshdeploy:rpc_server_up", lambda got: len(got) == 2)
        wait("sampled twice", "count_over_time(llamacpp:tokens_predicted_total[1m])",
             lambda got: got.get("node1", 0) >= 2)
        completed.set()
        wait("speed", "meshdeploy:generation_tokens_per_second:5m", lambda got: bool(got))
        idle.close()  # node3's rpc-server stops
        wait("node3 down", "meshdeploy:rpc_server_up", lambda got: got.get("node3") == 0)
        wait("workers up", "meshdeploy:workers_up", lambda got: got.get("") == 1)
    finally:
        held.close()
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
