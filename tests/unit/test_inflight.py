"""Guarded remote steps (meshdeploy.core.inflight), run by this machine's own sh, flock and
setsid: exit status and standard input pass through, a second run of a step waits for the
first, and stop_script ends a step whose run died (it keeps running in a session of its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from meshdeploy.core import inflight


@pytest.fixture(autouse=True)
def steps_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(inflight, "STEPS_DIR", str(tmp_path / "steps"))
    return tmp_path / "steps"


def run(script: str, stdin: str = "", timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_exit_status_and_stdin_are_the_steps():
    out = run(inflight.guarded("models.gguf[m/f.gguf]", 'read secret; echo "got $secret"; exit 3'),
              stdin="token\n")
    assert out.returncode == 3 and out.stdout == "got token\n", out


def test_a_second_run_of_the_step_waits_for_the_first(tmp_path):
    log = tmp_path / "log"
    first = subprocess.Popen(["sh", "-c", inflight.guarded(
        "llama_cpp.build", f"echo first-start >> {log}; sleep 1; echo first-end >> {log}")])
    deadline = time.monotonic() + 10
    while not log.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second = run(inflight.guarded("llama_cpp.build", f"echo second >> {log}"))
    first.wait(timeout=10)
    assert second.returncode == 0
    assert "llama_cpp.build: waiting for the same step of an earlier run to end" in second.stderr
    assert log.read_text().split() == ["first-start", "first-end", "second"]
    # Another step does not wait.
    assert run(inflight.guarded("models.gguf[m/f.gguf]", "true"), timeout=5).returncode == 0


def test_stop_script_ends_the_step_of_a_dead_run(steps_dir):
    # The run (its ssh session: the process group started here) dies; the step does not.
    runner = subprocess.Popen(["sh", "-c", inflight.guarded("rpc_cache.seed[50052]",
                                                            "sleep 300")],
                              start_new_session=True)
    pid_file = steps_dir / "rpc_cache.seed-50052-.pid"
    deadline = time.monotonic() + 10
    while not pid_file.exists() or len(pid_file.read_text().split()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    session = int(pid_file.read_text().split()[0])
    os.killpg(runner.pid, signal.SIGKILL)
    runner.wait(timeout=10)
    assert alive(session), "the step should outlive the run that started it"
    out = run(inflight.stop_script(grace=5))
    assert inflight.parse_stopped(out.stdout.splitlines()) == ["rpc_cache.seed[50052]"], out
    deadline = time.monotonic() + 5
    while alive(session):
        assert time.monotonic() < deadline, "the step still runs"
        time.sleep(0.05)
    # Its lock is free: the step runs again at once; nothing left to stop.
    assert run(inflight.guarded("rpc_cache.seed[50052]", "echo again"), timeout=5).stdout == \
        "again\n"
    assert run(inflight.stop_script()).stdout == ""


def test_lock_names_are_plain_file_names():
    assert inflight.lock_name("models.gguf[gemma/x y.gguf]") == "models.gguf-gemma-x-y.gguf-"
    assert inflight.parse_stopped(["stopped 42 models.gguf[a/b c.gguf]", "noise"]) == \
        ["models.gguf[a/b c.gguf]"]
