"""An arm64 worker applied by meshdeploy, its build cross-compiled on an x86-64 host of the
cluster: the whole product path, from the plan to a chat completion through the arm64
rpc-server and the next plan's "No changes". Not in CI: the arm64 host runs under qemu-user,
its base alone is about 6 minutes to debootstrap, and a cold CI run cannot spare it
(docs/lab.md, backends and architectures).

    sudo .venv/bin/python benchmarks/arm64_cross.py [--keep]

Lab `mdarm`: inventories/lab.yaml's three hosts, node3 booted from Debian 12 arm64 (qemu-user
through binfmt_misc: `apt install qemu-user-static`). node1 (llama-server) compiles its own
build, which node2 copies, and cross-compiles node3's with Debian's g++-aarch64-linux-gnu;
node3 copies that, runs it first as nobody, and serves layers of the model from its CPU.
Printed: the plan's build rows, the apply's step times, the binaries' architecture on node3,
a chat completion, the next plan, and llama-server's own lines on the RPC devices.
Exits 1 when a step fails.
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
from support.labfile import write_lab_file  # noqa: E402

from meshdeploy.lab import Lab  # noqa: E402

NAME = "mdarm"
NO_CHANGES = "No changes. The cluster matches the configuration."
CROSSED = "cross-compiled on node1 for aarch64"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the lab up afterwards")
    parser.add_argument("--native", action="store_true",
                        help="then compile node3's build on node3 itself, under qemu "
                             "(-replace=node3/llama_cpp.build): slow")
    args = parser.parse_args()
    handle = Lab(name=NAME, hosts=3, arches={"node3": "arm64"})
    return on_lab(handle, lambda info: run(info, args.native), args.keep)


def run(info, native: bool = False) -> int:
    print(info.run("node3", "uname -m; systemctl is-system-running", root=True).stdout)
    path = str(write_lab_file(info, Path(tempfile.mkdtemp(prefix="md-arm64-"))))
    plan = meshdeploy("plan", path)
    if plan.returncode not in (0, 2):
        failed("arm64_cross", "plan", plan)
    blocks = plan.stdout.split("\n\n")  # one per step, then the tables
    print("\n".join(b for b in blocks
                    if re.search(r"llama_cpp\.(build|cross|copy)|toolchain\.packages", b)))
    if CROSSED not in plan.stdout:
        failed("arm64_cross", "the plan's cross-compile (no such row)", plan)
    applied = meshdeploy("apply", path, "--auto-approve")
    if applied.returncode:
        failed("arm64_cross", "apply", applied)
    for line in applied.stdout.splitlines():
        if re.search(r"\b(ok|changed) \([0-9.]+ s\)", line):
            print(line)
    # The ELF header's e_machine (bytes 18-19): 00b7 is aarch64, 003e x86-64. The copy set
    # has no binutils, od is coreutils.
    print("node3's copy (each binary's ELF machine, its manifest, the worker):")
    print(info.run("node3", "cd /opt/meshdeploy/current/bin && for f in *; do "
                   "printf '%s e_machine=%s\\n' \"$f\" \"$(od -An -tx2 -j18 -N2 \"$f\" | tr -d ' ')\"; "
                   "done; cat ../manifest; systemctl is-active meshdeploy-rpc-50052",
                   root=True).stdout)
    through_arm = chat(info, "through node3's arm64 rpc-server")
    again = meshdeploy("plan", path)
    print(again.stdout[-400:])
    if NO_CHANGES not in again.stdout:
        failed("arm64_cross", "the next plan", again)
    # The same greedy completion without node3 (md-failover moves its layers to node2's x86
    # worker): the arm64 CPU code must give the same tokens.
    info.run("node3", "systemctl stop meshdeploy-rpc-50052", root=True, check=True)
    x86 = chat(info, "x86-64 workers only, after md-failover dropped node3", retry=180)
    if x86 != through_arm:
        sys.exit(f"arm64_cross: node3's layers answered {through_arm!r}, x86-64 {x86!r}")
    print("the same tokens through the arm64 worker and without it")
    info.run("node3", "systemctl start meshdeploy-rpc-50052", root=True, check=True)
    full_placement(info)
    if native:
        compile_on_node3(info, path, through_arm)
    gone = meshdeploy("destroy", path, "--auto-approve")
    if gone.returncode:
        failed("arm64_cross", "destroy", gone)
    print("arm64_cross: every step passed")
    return 0


def compile_on_node3(info, path: str, expected: str) -> None:
    """-replace=node3/llama_cpp.build: node3 compiles its own build (the toolchain comes first)
    under the same key, then answers as the cross build did, and the next plan is a no-op."""
    key = info.run("node3", "sed -n 's/^key=//p' /opt/meshdeploy/current/manifest",
                   root=True).stdout.strip()
    replaced = meshdeploy("apply", path, "--auto-approve", "-replace=node3/llama_cpp.build")
    if replaced.returncode:
        failed("arm64_cross", "the native build's apply", replaced)
    for line in replaced.stdout.splitlines():
        if re.search(r"node3 .*\b(ok|changed) \([0-9.]+ s\)", line):
            print(line)
    after = info.run("node3", "sed -n 's/^key=//p' /opt/meshdeploy/current/manifest; "
                     "ls /opt/meshdeploy/build", root=True).stdout.split()
    print(f"node3's key before {key}, after the native compile {after[0]}; its trees: "
          f"{' '.join(after[1:])}")
    if after[0] != key:
        sys.exit("arm64_cross: the native build has another key than the cross build")
    full_placement(info)
    native = chat(info, "through node3's natively compiled rpc-server", retry=180)
    if native != expected:
        sys.exit(f"arm64_cross: the native build answered {native!r}, the cross build "
                 f"{expected!r}")
    # That run made node3 its own builder, so node1's md-share port was opened to node2 alone;
    # the next plan opens it to node3 again (it copies from node1 from now on), then none.
    again = meshdeploy("plan", path)
    print("\n".join(line for line in again.stdout.splitlines() if "resource" in line
                    or "=" in line and "->" in line))
    if NO_CHANGES not in again.stdout:
        reapplied = meshdeploy("apply", path, "--auto-approve")
        if reapplied.returncode:
            failed("arm64_cross", "the apply after the native build", reapplied)
        again = meshdeploy("plan", path)
        if NO_CHANGES not in again.stdout:
            failed("arm64_cross", "the plan after the native build", again)
    print("native build: same key, same tokens, then No changes")


def full_placement(info, timeout: float = 300) -> None:
    """Wait until md-failover on node1 runs the full placement again (node3 back)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        done = info.run("node1", "cat /run/meshdeploy-server-main/failover.json", root=True)
        if done.returncode == 0 and done.stdout.strip():
            seen = json.loads(done.stdout)
            if seen.get("state") == "serving" and not seen.get("lost"):
                print(f"md-failover back on the full placement after "
                      f"{time.monotonic() - started:.0f} s")
                return
        time.sleep(2)
    sys.exit("arm64_cross: md-failover did not go back to the full placement")


def chat(info, how: str, retry: float = 0) -> str:
    """One greedy chat completion through node1's llama-server; its text (printed with its
    timings). `retry`: seconds to keep asking while it fails (a failover under way)."""
    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 16, "temperature": 0, "seed": 1})
    started = time.monotonic()
    while True:
        done = info.run("node1", "curl -sf http://127.0.0.1:8080/v1/chat/completions "
                                 f"-H 'Content-Type: application/json' -d '{body}'", timeout=900)
        if done.returncode == 0 or time.monotonic() - started > retry:
            break
        time.sleep(2)
    took = time.monotonic() - started
    if done.returncode:
        print(done.stdout, done.stderr)
        sys.exit(f"arm64_cross: the chat completion {how} failed")
    answer = json.loads(done.stdout)
    text = answer["choices"][0]["message"]["content"]
    timings = answer.get("timings", {})
    print(f"\nchat completion {how} in {took:.1f} s: {text!r}; prompt "
          f"{timings.get('prompt_per_second', 0):.2f} tok/s, generation "
          f"{timings.get('predicted_per_second', 0):.2f} tok/s")
    return text


if __name__ == "__main__":
    sys.exit(main())
