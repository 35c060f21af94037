"""Bytes on the lab's wires, link shaping, and a synthetic-model cluster file, for seeding checks.

Every host's traffic crosses its veth `v-<host>` on the lab bridge, so that interface's tx
counter (bridge -> host) is exactly what the orchestrator and the mirrors sent to the host.
"""

from __future__ import annotations

import json
import re
import subprocess
from contextlib import contextmanager
from pathlib import Path

from meshdeploy.lab.errors import LabError
from support.labfile import for_lab

REPO = Path(__file__).resolve().parents[2]


def _ip(*args: str) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise LabError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def tx_bytes(lab: str, host: str) -> int:
    """Bytes the bridge has sent to `host` since its veth was created."""
    doc = json.loads(_ip("-n", lab, "-s", "-j", "link", "show", f"v-{host}"))
    return int(doc[0]["stats64"]["tx"]["bytes"])


def shape(lab: str, host: str, rate: str | None) -> None:
    """Limit bridge -> host to `rate` (tc tbf, e.g. "100mbit"); None removes the limit."""
    dev = f"v-{host}"
    subprocess.run(["ip", "netns", "exec", lab, "tc", "qdisc", "del", "dev", dev, "root"],
                   capture_output=True)
    if rate:
        proc = subprocess.run(["ip", "netns", "exec", lab, "tc", "qdisc", "add", "dev", dev,
                               "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise LabError(f"tc on {dev}: {proc.stderr.strip()}")


@contextmanager
def shaped(lab: str, hosts, rate: str | None):
    """Links bridge -> each of `hosts` limited to `rate` inside the block, unlimited after."""
    for h in hosts:
        shape(lab, h, rate)
    try:
        yield
    finally:
        for h in hosts:
            shape(lab, h, None)


def cluster_yaml(info, repo: str, file: str, sha256: str, cache: bool,
                 tensor_split: str = "[1, 1]", ctx: int = 512) -> str:
    """inventories/lab.yaml for lab `info`, serving the synthetic model through both workers."""
    text = (REPO / "inventories" / "lab.yaml").read_text()
    text = for_lab(text, info)
    text = text.replace("      - port: 50052\n",
                        f"      - {{port: 50052, cache: {'true' if cache else 'false'}}}\n")
    head, _, _ = text.partition("\nmodels:\n")
    return head + f"""
models:
  synthetic:
    huggingface:
      repo: {repo}
      file: {file}
      sha256: {sha256}
servers:
  main:
    host: node1
    model: synthetic
    port: 8080
    bind: 127.0.0.1
    ctx_size: {ctx}
    tensor_split: {tensor_split}
    health: {{retries: 600, interval: 0.5}}
"""


def restart_server(info, unit: str = "meshdeploy-server-main", port: int = 8080,
                   budget: float = 900) -> float:
    """Restart llama-server on node1; seconds until /health answers 200."""
    script = (f"sudo systemctl restart {unit}; s=$(date +%s.%N); "
              f"for i in $(seq {int(budget * 20)}); do "
              f"c=$(curl -s -o /dev/null -w '%{{http_code}}' http://127.0.0.1:{port}/health); "
              "[ \"$c\" = 200 ] && { e=$(date +%s.%N); echo \"ready $s $e\"; exit 0; }; "
              "sleep 0.05; done; echo timeout; exit 1")
    proc = info.run("node1", script, timeout=budget + 60)
    m = re.search(r"ready ([\d.]+) ([\d.]+)", proc.stdout)
    if not m:
        raise LabError(f"llama-server did not become healthy: {proc.stdout[-300:]} "
                       f"{proc.stderr[-300:]}")
    return float(m.group(2)) - float(m.group(1))


def complete(info, prompt: str = "hello world", n_predict: int = 24, port: int = 8080) -> str:
    """Greedy completion (temperature 0, fixed seed) from node1's llama-server."""
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                       "seed": 42, "cache_prompt": False})
    proc = info.run("node1", f"curl -s --max-time 300 http://127.0.0.1:{port}/completion "
                             f"-H 'Content-Type: application/json' -d '{body}'")
    try:
        return json.loads(proc.stdout)["content"]
    except (ValueError, KeyError):
        raise LabError(f"no completion from llama-server: {proc.stdout[-300:]}") from None

