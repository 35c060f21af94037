"""Every runbook in docs/runbooks/ executed, step by step, on real hosts (lab `mdrb`).

The runbooks run in the order of docs/runbooks/README.md's table against one converged cluster
(node1 orchestrator, node2 and node3 workers, node4 a spare host that add-worker.md brings in):
each ```sh block through bash in the folder holding `cluster.yaml`, with `meshdeploy` on PATH
running this checkout's code; each ```yaml edit applied to `cluster.yaml` with ruamel.yaml; every
`expect` marker checked. A failure names the runbook, the step and its output. The format is in
docs/runbooks/README.md; the parser in tests/support/runbook.py.

Also measures the time from an rpc-server killed with SIGKILL to the next successful chat
completion through llama-server (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import own_lab

from meshdeploy.lab import base, hfstore
from support import runbook
from support.synthetic import Shape, write_llama
from support.labfile import for_lab, lab_text

# Its own lab, run in scripts/test's first lab process: about 250-290 s, which evens out the two.
pytestmark = [pytest.mark.lab, pytest.mark.build, pytest.mark.first_process]

LAB_NAME = "mdrb"
REPO = Path(__file__).resolve().parents[2]
RUNBOOKS = REPO / "docs" / "runbooks"
# The small second model of change-model.md, laid out in the lab's Hugging Face mirror.
TINY_REPO, TINY_FILE = "meshdeploy-lab/tiny-llama-GGUF", "tiny-llama-f16.gguf"
TINY = Shape(n_layers=4, n_embd=256, n_ff=768, n_head=4, n_head_kv=2)
STEP_TIMEOUT = 3600  # a step that builds llama.cpp (upgrade, a new worker) takes minutes


@pytest.fixture(scope="module")
def rb_lab(lab_available, request):
    # node4 is a lab host like the others, in no cluster file until add-worker.md.
    with own_lab(request, LAB_NAME, hosts=4, toolchain=True) as both:
        yield both


@pytest.fixture(scope="module")
def workdir(rb_lab, tmp_path_factory):
    """The operator's folder: cluster.yaml (the lab's file) and a bin/ with `meshdeploy`."""
    info, _ = rb_lab
    folder = tmp_path_factory.mktemp("runbooks")
    (folder / runbook.CLUSTER_FILE).write_text(lab_text(info))
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "meshdeploy"
    tool.write_text(f'#!/bin/sh\nexec {sys.executable} -m meshdeploy "$@"\n')
    tool.chmod(0o755)
    model = write_llama(folder / TINY_FILE, TINY)
    hfstore.add_file(base.cache_root() / "hf", TINY_REPO, TINY_FILE, model)
    return folder


def shell(workdir: Path, text: str, timeout: float = STEP_TIMEOUT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{workdir / 'bin'}:{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=workdir, env=env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def converged(workdir):
    proc = shell(workdir, "meshdeploy apply cluster.yaml --auto-approve")
    assert proc.returncode == 0, proc.stdout[-6000:]
    return workdir


# ---- rpc-server killed: time to the next successful completion ---------------------------------

def completes(info) -> bool:
    """One short chat completion from node1's own loopback (its network namespace)."""
    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 4, "temperature": 0})
    proc = subprocess.run(["ip", "netns", "exec", info.host("node1").netns, "curl", "-s",
                           "--max-time", "30", "-H", "Content-Type: application/json",
                           "-d", body, "http://127.0.0.1:8080/v1/chat/completions"],
                          capture_output=True, text=True)
    try:
        return json.loads(proc.stdout)["usage"]["completion_tokens"] > 0
    except (ValueError, KeyError, TypeError):
        return False


def serving_full(info, timeout: float) -> bool:
    """Whether md-failover runs llama-server on the full placement within `timeout` s (after a
    worker's loss it goes back once the worker answers again, and reloads meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = info.run("node1", "sudo -n cat /run/meshdeploy-server-main/failover.json")
        try:
            state = json.loads(done.stdout)
        except ValueError:
            state = {}
        if state.get("state") == "serving" and state.get("lost") == [] and completes(info):
            return True
        time.sleep(1)
    return False


def restarts(info, host: str, unit: str) -> int:
    return int(info.run(host, f"systemctl show -p NRestarts --value {unit}").stdout.strip())


def test_rpc_server_killed_recovery_time(converged, rb_lab):
    info, _ = rb_lab
    seconds = []
    for run in range(3):
        # Each kill from the full placement: after the last one md-failover served without
        # node3, and goes back (a reload) once node3 answers again.
        assert serving_full(info, 120), "not back on the full placement before the kill"
        before = (restarts(info, "node3", "meshdeploy-rpc-50052"),
                  restarts(info, "node1", "meshdeploy-server-main"))
        # The kill's own time, read on node3 (the hosts share the machine's clock).
        killed = info.run("node3", "sudo systemctl kill --kill-whom=main -s KILL "
                                   "meshdeploy-rpc-50052 && date +%s.%N")
        assert killed.returncode == 0, killed.stderr
        t_kill = float(killed.stdout.strip())
        failed = 0  # requests that failed before the first success
        while time.time() - t_kill < 180:
            if completes(info):
                break
            failed += 1
            time.sleep(0.5)
        else:
            pytest.fail(f"no completion within 180 s of the kill (run {run + 1})")
        took = time.time() - t_kill  # until the answer arrived
        after = (restarts(info, "node3", "meshdeploy-rpc-50052"),
                 restarts(info, "node1", "meshdeploy-server-main"))
        print(f"run {run + 1}: next successful completion {took:.2f} s after SIGKILL; "
              f"{failed} failed requests; rpc-server restarts +{after[0] - before[0]}, "
              f"llama-server restarts +{after[1] - before[1]}")
        # systemd brought the worker back; md-failover restarted llama-server inside its unit
        # (or, where llama-server aborted and every worker answered by then, systemd did).
        assert after[0] == before[0] + 1, (before, after)
        seconds.append(took)
    print(f"rpc-server SIGKILL -> next completion: median {statistics.median(seconds):.2f} s "
          f"of {', '.join(f'{s:.2f}' for s in seconds)}")
    assert serving_full(info, 120)
    assert shell(converged, "meshdeploy status cluster.yaml").returncode == 0


# ---- the runbooks -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", runbook.order(RUNBOOKS))
def test_runbook(name, converged, rb_lab):
    info, _ = rb_lab
    book = runbook.parse(RUNBOOKS / name)
    assert book.steps, f"{name} has no executable step"
    cluster_file = converged / runbook.CLUSTER_FILE
    # The file as the runbooks before this one leave it (also when one of them failed half way:
    # a failure does not spread into the next runbook's file).
    runbook.file_before(RUNBOOKS, name, cluster_file,
                        lab_text(info),
                        lambda text: for_lab(text, info))
    for n, step in enumerate(book.steps, 1):
        where = f"{name}, step {n} ({step.describe()})"
        if step.kind == "edit":
            runbook.apply_edit(replace(step, text=for_lab(step.text, info)), cluster_file)
            continue
        started = time.monotonic()
        proc = shell(converged, for_lab(step.text, info))
        out = proc.stdout
        print(f"--- {where}: exit {proc.returncode} in {time.monotonic() - started:.1f} s\n"
              f"{out[-4000:]}")
        problems = []
        if proc.returncode != step.exit_code:
            problems.append(f"exit status {proc.returncode}, expected {step.exit_code}")
        problems += [f"output lacks {text!r}" for text in step.expect if text not in out]
        problems += [f"output has {text!r}" for text in step.expect_not if text in out]
        if problems:
            pytest.fail(f"{where}: {'; '.join(problems)}\n--- output (last 6000 chars):\n"
                        f"{out[-6000:]}", pytrace=False)
