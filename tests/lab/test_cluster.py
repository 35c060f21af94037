"""End to end on the lab: validate -> plan -> apply -> chat -> no-op plan -> status.

Three real hosts (orchestrator node1, CPU workers node2 and node3), llama.cpp from the lab's git
mirror at a tag, the gemma GGUF from the lab's Hugging Face mirror. The build runs once per lab
(shared ccache, serial build); later tests in this module reuse the converged cluster.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.lab, pytest.mark.build]


REPO = Path(__file__).resolve().parents[2]


def meshdeploy(*args, timeout=3600):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "meshdeploy", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    proc.seconds = time.monotonic() - started
    print(f"$ meshdeploy {' '.join(map(str, args))}  -> {proc.returncode} in {proc.seconds:.1f} s")
    print(proc.stdout[-6000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    return proc


@pytest.fixture(scope="module")
def cluster_file(lab, tmp_path_factory):
    """The lab inventory, copied so its lock file lands in a temporary folder."""
    folder = tmp_path_factory.mktemp("cluster")
    target = folder / "lab.yaml"
    text = (REPO / "inventories" / "lab.yaml").read_text()
    text = text.replace("http://127.0.0.1:18080", lab.mirrors["hf_api_endpoint"])
    text = text.replace("/var/lib/meshdeploy/lab/mdlab/ssh_config", lab.ssh["config"])
    target.write_text(text)
    return target


@pytest.fixture(scope="module")
def converged(cluster_file):
    first_plan = meshdeploy("plan", cluster_file, "--detailed-exitcode")
    assert first_plan.returncode == 2, first_plan.stderr
    applied = meshdeploy("apply", cluster_file, "--auto-approve")
    assert applied.returncode == 0, applied.stderr
    return {"plan": first_plan, "apply": applied}



def test_validate(cluster_file):
    proc = meshdeploy("validate", cluster_file)
    assert proc.returncode == 0, proc.stderr
    assert "3 hosts, 2 rpc-servers, 1 model" in proc.stdout


def test_first_plan_creates_everything(converged):
    out = converged["plan"].stdout
    for address in ("node1/toolchain.packages", "node1/llama_cpp.build", "node1/models.gguf[gemma]",
                    "node2/services.rpc_server[50052]", "node3/services.rpc_server[50052]",
                    "node1/services.llama_server[main]"):
        assert f"# {address} will be created" in out
    assert re.search(r"^Plan: \d+ to add, 0 to change, 0 to destroy\.$", out, re.M)


def test_apply_writes_the_lock(converged, cluster_file, lab):
    lock = json.loads(cluster_file.with_name("lab.lock.json").read_text())
    assert lock["llama_cpp"]["commit"] == lab.mirrors["git_tags"]["b11312"]


def test_chat_completion_uses_the_workers(converged, lab):
    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 16, "temperature": 0, "seed": 1})
    proc = lab.run("node1", f"curl -sf http://127.0.0.1:8080/v1/chat/completions "
                            f"-H 'Content-Type: application/json' -d '{body}'")
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["usage"]["completion_tokens"] > 0
    assert answer["choices"][0]["message"]["content"].strip()
    # Layers (and so weights) live on the remote workers: llama-server reports an RPC model
    # buffer per worker in its load log.
    log = lab.run("node1", "sudo journalctl -u meshdeploy-server-main --no-pager -o cat").stdout
    for worker in ("10.200.0.12:50052", "10.200.0.13:50052"):
        sizes = re.findall(rf"RPC\d*\[{re.escape(worker)}\]\s+model buffer size\s*=\s*([\d.]+) MiB", log)
        assert sizes and float(sizes[-1]) > 1, f"no model buffer on {worker}:\n{log[-3000:]}"


def test_second_plan_is_empty(converged, cluster_file):
    proc = meshdeploy("plan", cluster_file, "--detailed-exitcode")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("No changes. The cluster matches the configuration.")


def test_plan_json_counts_remote_commands(converged, cluster_file):
    proc = meshdeploy("plan", cluster_file, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["counts"] == {"add": 0, "change": 0, "destroy": 0}


def test_status_all_healthy(converged, cluster_file):
    proc = meshdeploy("status", cluster_file, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout)
    services = {(r["host"], r["service"]) for r in rows}
    assert {("node1", "llama-server main"), ("node2", "rpc-server :50052"),
            ("node3", "rpc-server :50052")} <= services
    assert all(r["healthy"] for r in rows)
    server = next(r for r in rows if r["service"] == "llama-server main")
    assert server["model"] and "gemma" in server["model"]


def test_saved_plan_refuses_drift(converged, cluster_file, tmp_path, lab):
    planfile = tmp_path / "cluster.plan"
    proc = meshdeploy("plan", cluster_file, "-out", planfile)
    assert proc.returncode == 0 and planfile.exists()
    lab.run("node3", "sudo systemctl stop meshdeploy-rpc-50052", check=True)
    try:
        stale = meshdeploy("apply", planfile)
        assert stale.returncode == 6, stale.stderr
        assert "node3 changed since the plan was made" in stale.stderr
    finally:
        fixed = meshdeploy("apply", cluster_file, "--auto-approve")
        assert fixed.returncode == 0, fixed.stderr


def test_unknown_ref_is_one_clear_error(converged, cluster_file, tmp_path):
    bad = tmp_path / "badref.yaml"
    bad.write_text(cluster_file.read_text().replace("ref: b11312", "ref: b99999"))
    proc = meshdeploy("plan", bad)
    assert proc.returncode == 1, proc.stderr
    assert "b99999" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unreachable_host_is_one_clear_error(converged, cluster_file, tmp_path, lab):
    # node9's SSH goes into node3's namespace to a port where nothing listens: a host that is
    # down, without sending a packet anywhere but inside the lab.
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(Path(lab.ssh["config"]).read_text() + (
        "\nHost node9\n    HostName node9\n    User deploy\n"
        f"    IdentityFile {lab.ssh['key']}\n    StrictHostKeyChecking no\n"
        "    UserKnownHostsFile /dev/null\n"
        f"    ProxyCommand ip netns exec {lab.name}-node3 nc 127.0.0.1 2222\n"))
    text = cluster_file.read_text().replace("  node3:\n", "  node9:\n")
    text = text.replace(lab.ssh["config"], str(ssh_config))
    bad = tmp_path / "unreachable.yaml"
    bad.write_text(text)
    proc = meshdeploy("plan", bad)
    assert proc.returncode == 4, proc.stderr
    assert "node9" in proc.stderr and "Traceback" not in proc.stderr
