"""A `backend: vulkan` worker applied by meshdeploy, on Mesa's lavapipe (a Vulkan driver that runs
on the CPU), beside a CPU worker: the whole product path, from the plan to a chat completion and
the next plan's "No changes". Not in CI: the Vulkan build alone (shaders included) takes about
7 minutes of 2 cores, a cold CI run cannot spare it (docs/lab.md, backends).

    sudo .venv/bin/python benchmarks/vulkan_lavapipe.py [--keep]

Lab `mdvk`: node1 (Debian 12) runs llama-server, node2 (Debian 12) an rpc-server on its CPU,
node3 (Debian 13, Mesa 25 with lavapipe) is `backend: vulkan` with
`vulkan_visible_devices: [0]` (ggml-vulkan never uses a CPU driver unless told to) and two
rpc-servers: Vulkan0 on 50052, its CPU on 50053. The hosts start from the plain base, so the
toolchain role installs the Vulkan packages itself. Printed: the plan's rows of node3, the
apply's step times, vulkaninfo's device, a chat completion, the next plan, and Vulkan0's free
memory in the placement table against what ggml-vulkan reports as the worker starts.
A new Vulkan host takes two applies: the first plan cannot read Vulkan0's memory (vulkaninfo
arrives with its packages) and says so; the second places by memory. Exits 1 when a step fails.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from labrun import failed, meshdeploy, on_lab  # noqa: E402
from support.labfile import lab_text, write_lab_file  # noqa: E402

from meshdeploy.lab import Lab  # noqa: E402

NAME = "mdvk"
NO_CHANGES = "No changes. The cluster matches the configuration."
NODE3 = """  node3:
    address: {address}
    ssh: {{user: deploy, config: {config}, sudo: true}}
    backend: vulkan
    vulkan_visible_devices: [0]   # lavapipe, GPU0 in vulkaninfo
    rpc_servers:
      - {{port: 50052, device: Vulkan0}}
      - {{port: 50053, device: CPU}}
"""


def cluster_text(info) -> str:
    text = lab_text(info)
    start, end = text.index("  node3:\n"), text.index("\nmodels:\n")
    node3 = NODE3.format(address=info.host("node3").address, config=info.ssh["config"])
    return text[:start] + node3 + text[end + 1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    args = parser.parse_args()
    handle = Lab(name=NAME, hosts=3, suites={"node3": "trixie"})
    return on_lab(handle, run, args.keep)


def run(info) -> int:
    work = Path(tempfile.mkdtemp(prefix="md-vulkan-"))
    path = str(write_lab_file(info, work, text=cluster_text(info)))
    plan = meshdeploy("plan", path)
    if plan.returncode not in (0, 2):
        failed("vulkan_lavapipe", "plan", plan)
    print("\n".join(line for line in plan.stdout.splitlines()
                    if "node3" in line or "device" in line.lower()))
    applied = meshdeploy("apply", path, "--auto-approve")
    if applied.returncode:
        failed("vulkan_lavapipe", "apply", applied)
    for line in applied.stdout.splitlines():
        if re.search(r"\b(ok|changed) \([0-9.]+ s\)", line) and \
                re.search(r"build|copy|packages|server|rpc", line):
            print(line)
    if "vulkaninfo is not on node3 yet" in plan.stdout:
        # The first plan could not read Vulkan0's memory (vulkaninfo comes with the packages):
        # the second apply places by memory and starts md-failover, as the plan said.
        again = meshdeploy("apply", path, "--auto-approve")
        if again.returncode:
            failed("vulkan_lavapipe", "the second apply", again)
        print("\n".join(line for line in again.stdout.splitlines()
                        if re.search(r"\b(ok|changed) \([0-9.]+ s\)|Vulkan0", line)))
    print("vulkaninfo on node3:")
    print(info.run("node3", "vulkaninfo --summary 2>/dev/null | grep -E "
                   "'deviceType|deviceName|driverName|apiVersion' | head -8", root=True).stdout)
    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 16, "temperature": 0, "seed": 1})
    started = time.monotonic()
    chat = info.run("node1", "curl -sf http://127.0.0.1:8080/v1/chat/completions "
                             f"-H 'Content-Type: application/json' -d '{body}'", timeout=900)
    took = time.monotonic() - started
    if chat.returncode:
        print(chat.stdout, chat.stderr)
        sys.exit("vulkan_lavapipe: the chat completion failed")
    answer = json.loads(chat.stdout)
    print(f"\nchat completion in {took:.1f} s: {answer['usage']} "
          f"{answer['choices'][0]['message']['content']!r}; timings: "
          f"{json.dumps(answer.get('timings', {}))}")
    again = meshdeploy("plan", path)
    print(again.stdout[-600:])
    if NO_CHANGES not in again.stdout:
        failed("vulkan_lavapipe", "the next plan", again)
    compare(info, path)
    gone = meshdeploy("destroy", path, "--auto-approve")
    if gone.returncode:
        failed("vulkan_lavapipe", "destroy", gone)
    print("vulkan_lavapipe: every step passed")
    return 0


def compare(info, path: str) -> None:
    """What ggml-vulkan itself reports for the device (rpc-server's "Devices:" lines as it
    starts) against the free memory the placement table counts on, read a moment later by the
    plan's probe (vulkaninfo): the worker is restarted first so that both are read together."""
    info.run("node3", "systemctl restart meshdeploy-rpc-50052", root=True, check=True)
    plan = meshdeploy("plan", path)
    logged = info.run("node3", "journalctl -u meshdeploy-rpc-50052 -u meshdeploy-rpc-50053 "
                      "--no-pager -o cat | grep -vi 'client connection' | tail -16",
                      root=True).stdout
    print("rpc-servers on node3 (their last starts):\n" + logged)
    table = re.search(r"(?m)^node3:50052/Vulkan0\s.*\s([0-9.]+)\s+[0-9.]+\s*$", plan.stdout)
    reported = re.findall(r"Vulkan0: .*\((\d+) MiB, (\d+) MiB free\)", logged)
    if not (table and reported):
        print(plan.stdout[-3000:])
        sys.exit("vulkan_lavapipe: Vulkan0's free memory is missing from the placement table "
                 "or from the rpc-server's log")
    planned, free = float(table.group(1)) * 1e9, int(reported[-1][1]) << 20
    print(f"Vulkan0 free: placement table {planned / 2**20:.0f} MiB, ggml-vulkan "
          f"{free >> 20} MiB (ratio {planned / free:.4f}; the table rounds to 10 MB)")


if __name__ == "__main__":
    sys.exit(main())
