"""meshdeploy bench on real hosts: the lab cluster on the shared converged lab (conftest's
converged_lab: node1 orchestrator, node2 and node3 workers), benched through llama-server's
HTTP API over SSH, alone and against the same build and model on node1 without workers.

Checks that the figures are llama-server's own (token counts equal to what the server reports
to a request sent by hand on the host, rates equal to tokens over its milliseconds), that the
local copy is always stopped (also on Ctrl-C), that the last result is kept and a second bench
shows the change, and that an API key is used without ever being shown or kept. The sweep
(--sweep) measures splits over the two workers with the deployed server stopped, keeps the
fitted speeds beside the cluster file and leaves the deployed server as it found it.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time

import pytest
from support.cli import as_at_a_terminal, meshdeploy
from test_cluster import variant
from test_secrets import ssh

pytestmark = [pytest.mark.lab, pytest.mark.build, pytest.mark.quiet]

LOCAL_UNIT = "meshdeploy-bench-main"


@pytest.fixture(scope="module")
def bn_lab(converged_lab):
    info, handle, _ = converged_lab
    return info, handle


@pytest.fixture(scope="module")
def cluster_file(converged_lab):
    return converged_lab[2]


def bench(cluster_file, *args):
    proc = meshdeploy("bench", cluster_file, *args)
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def first(cluster_file):
    return json.loads(bench(cluster_file, "--runs", "2", "--json").stdout)


def by_hand(info, prompt: str, n_predict: int) -> dict:
    """One /completion sent with curl on node1 itself: llama-server's own answer."""
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0, "seed": 42,
                       "cache_prompt": False, "ignore_eos": True})
    proc = ssh(info, "node1", "curl -sf http://127.0.0.1:8080/completion "
                              "-H 'Content-Type: application/json' --data-binary @-", body)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["timings"]


def test_figures_are_llama_servers_own(first, bn_lab, cluster_file):
    from meshdeploy.engine.server_api import PROMPTS

    info, _ = bn_lab
    assert first["format_version"] == 1 and first["cluster"] == "lab"
    (server,) = first["servers"]
    assert server["server"] == "main" and server["host"] == "node1" and server["model"] == "gemma"
    assert server["build"]["commit"] == info.mirrors["git_tags"]["b11312"]
    assert server["change"] is None  # nothing kept before
    assert [p["prompt"] for p in server["prompts"]] == [name for name, _ in PROMPTS]
    assert len(server["samples"]) == 2
    for run in server["samples"]:
        for sample in run:
            assert sample["predicted_n"] == 64 and sample["prompt_n"] > 0
            # The rate is the server's own: its tokens over its milliseconds.
            assert sample["prompt_per_second"] == pytest.approx(
                sample["prompt_n"] * 1000 / sample["prompt_ms"], rel=1e-3)
    for row in server["prompts"] + [server["overall"]]:
        for metric in ("pp", "tg"):
            s = row[metric]
            assert 0 < s["min"] <= s["median"] <= s["max"], (row, metric)
    # Token counts equal what the server reports to the same request sent by hand on the host;
    # its rates are in the same range (the machine is shared and noisy: a wide band).
    for (name, text), row in zip(PROMPTS, server["prompts"]):
        own = by_hand(info, text, 64)
        assert own["prompt_n"] == row["prompt_n"] and own["predicted_n"] == 64, name
        assert row["tg"]["median"] / 5 < own["predicted_per_second"] < row["tg"]["median"] * 5
    state = json.loads(cluster_file.with_name("lab.bench.json").read_text())
    assert state["format_version"] == 1
    assert state["servers"]["main"]["overall"] == server["overall"]


def test_compare_local_and_the_change_since_the_last_bench(first, bn_lab, cluster_file):
    info, _ = bn_lab
    data = json.loads(bench(cluster_file, "--runs", "2", "--compare-local", "--json").stdout)
    (server,) = data["servers"]
    local = server["local"]
    assert "skipped" not in local, local
    assert "--rpc" not in local["argv"] and local["argv"][0].startswith("/opt/meshdeploy/")
    assert local["argv"][local["argv"].index("--host") + 1] == "127.0.0.1"
    assert "GiB available" in local["fits"]
    for metric in ("pp", "tg"):
        assert local["overall"][metric]["median"] > 0
        assert server["ratio_to_local"][metric] == pytest.approx(
            server["overall"][metric]["median"] / local["overall"][metric]["median"], abs=1e-3)
        assert server["change"]["overall"][metric] == pytest.approx(
            server["overall"][metric]["median"] / first["servers"][0]["overall"][metric]["median"],
            abs=1e-3)
    assert server["change"]["since"] == first["servers"][0]["time"]
    # The copy is gone, and the cluster's server still answers.
    assert info.run("node1", f"systemctl is-active {LOCAL_UNIT}").stdout.strip() != "active"
    port = local["port"]
    assert info.run("node1", f"curl -s -o /dev/null -w '%{{http_code}}' "
                             f"http://127.0.0.1:{port}/health").stdout in ("000", "")
    assert info.run("node1", "curl -sf http://127.0.0.1:8080/health").returncode == 0


def test_text_view_shows_the_change(first, cluster_file):
    out = bench(cluster_file, "--runs", "1").stdout
    assert "llama-server main on node1: model gemma" in out
    assert "Change since the last bench (" in out
    assert f"Kept as the last result in {cluster_file.with_name('lab.bench.json')}" in out


def test_ctrl_c_stops_the_local_copy(first, bn_lab, cluster_file):
    info, _ = bn_lab
    proc = subprocess.Popen([sys.executable, "-m", "meshdeploy", "bench", str(cluster_file),
                             "--runs", "3", "--compare-local"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            preexec_fn=as_at_a_terminal)
    seen = []
    deadline = time.monotonic() + 300
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(f"starting {LOCAL_UNIT}"):
            break
        assert time.monotonic() < deadline, seen
    # Wait until the copy runs, then interrupt mid-measurement.
    for _ in range(60):
        if info.run("node1", f"systemctl is-active {LOCAL_UNIT}").stdout.strip() == "active":
            break
        time.sleep(0.5)
    assert info.run("node1", f"systemctl is-active {LOCAL_UNIT}").stdout.strip() == "active"
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()  # what it printed until then says where it hung
        _, err = proc.communicate()
        raise AssertionError("bench still runs 120 s after Ctrl-C:\n" + "".join(seen) + err)
    assert proc.returncode == 130, "".join(seen) + err
    assert "interrupted" in err and "Traceback" not in err
    assert info.run("node1", f"systemctl is-active {LOCAL_UNIT}").stdout.strip() != "active"


def keyed_cluster(info, cluster_file, name: str):
    """(key, cluster file): a fresh API key in a root-only file on node1, and a variant of the
    cluster file named NAME.yaml whose server reads it, applied (apply `cluster_file` again to
    put the cluster back)."""
    key = "mdkey-" + secrets.token_hex(16)
    path = f"/etc/meshdeploy-secrets/{name}-key"
    put = ssh(info, "node1", "sudo sh -c 'umask 077; mkdir -p /etc/meshdeploy-secrets; "
                             f"cat > {path}'", key + "\n")
    assert put.returncode == 0, put.stderr
    keyed = variant(cluster_file, f"{name}.yaml", "    port: 8080\n",
                    f"    port: 8080\n    api_key_file: {path}\n")
    applied = meshdeploy("apply", keyed, "--auto-approve")
    assert applied.returncode == 0, applied.stderr
    return key, keyed


def test_api_key_is_used_and_never_shown(first, bn_lab, cluster_file):
    info, _ = bn_lab
    key, keyed = keyed_cluster(info, cluster_file, "keyed")
    try:
        # The key is needed: without it the server refuses /completion.
        refused = info.run("node1", "curl -s -o /dev/null -w '%{http_code}' -X POST "
                                    "http://127.0.0.1:8080/completion -d '{}'")
        assert refused.stdout == "401"
        proc = bench(keyed, "--runs", "1", "--compare-local", "--json")
        server = json.loads(proc.stdout)["servers"][0]
        assert server["overall"]["tg"]["median"] > 0
        assert "skipped" not in server["local"] and server["local"]["overall"]["tg"]["median"] > 0
        kept = keyed.with_name(keyed.stem + ".bench.json").read_text()
        for text in (proc.stdout, proc.stderr, kept):
            assert key not in text
    finally:
        restored = meshdeploy("apply", cluster_file, "--auto-approve")
        assert restored.returncode == 0, restored.stderr


def test_sweep_fits_each_devices_speed_and_brings_the_server_back(bn_lab, cluster_file):
    info, _ = bn_lab
    before = deployed_argv(info)
    speeds = cluster_file.with_name("lab.speed.json")
    try:
        _sweep(info, cluster_file, before)
    finally:
        # The kept speeds move the plan's split (placement for speed): later modules share
        # this converged lab as inventories/lab.yaml deploys it, without them.
        speeds.unlink(missing_ok=True)
    assert meshdeploy("plan", cluster_file, "--detailed-exitcode").returncode == 0


def _sweep(info, cluster_file, before: list[str]) -> None:
    from meshdeploy.views import sweep as view

    proc = bench(cluster_file, "--sweep", "--points", "4", "--runs", "1", "--auto-approve",
                 "--json")
    assert "bench --sweep stops llama-server main on node1 for the sweep" in proc.stderr
    (server,) = json.loads(proc.stdout)["servers"]
    print(view.render_text([server]))  # the table, in the captured output (pytest -rP)
    assert "calibration" in server, server
    assert all(s["loaded"] for s in server["splits"]), server["splits"]
    kept = json.loads(cluster_file.with_name("lab.speed.json").read_text())
    entry = kept["servers"]["main"]
    assert entry["devices"] == ["node2:50052/CPU", "node3:50052/CPU"]
    assert entry["commit"] == info.mirrors["git_tags"]["b11312"]
    assert entry["points"] == 4 and len(entry["splits"]) == 4
    assert len({tuple(s["layers"]) for s in entry["splits"]}) == 4
    for split in entry["splits"]:
        for metric in ("gen", "prompt"):
            assert split["measured"][metric] > 0, split
            predicted = split["predicted"][metric]
            assert isinstance(predicted, float) and predicted > 0, split
    assert len(entry["gen"]) == 2 and all(v >= 0 for v in entry["gen"])
    # One HELLO round trip to each worker, timed on node1 through the real rpc-servers (a
    # veth hop in the lab: well under 50 ms), and the model on node1 alone, as
    # --compare-local runs it.
    assert len(entry["rtt"]) == 2 and all(0 < r < 0.05 for r in entry["rtt"]), entry["rtt"]
    assert entry["alone"]["gen"] > 0 and entry["alone"]["prompt"] > 0, server["alone"]
    assert info.run("node1", "systemctl is-active meshdeploy-bench-main").stdout.strip() \
        != "active"
    # The copies are gone, and the deployed server answers again, as it was deployed.
    assert info.run("node1", "systemctl is-active meshdeploy-sweep-main").stdout.strip() \
        != "active"
    assert info.run("node1", "curl -sf http://127.0.0.1:8080/health").returncode == 0
    assert deployed_argv(info) == before


def deployed_argv(info) -> list[str]:
    pid = info.run("node1", "systemctl show -p MainPID --value meshdeploy-server-main").stdout
    assert pid.strip().isdigit() and pid.strip() != "0", pid
    return info.run("node1", f"cat /proc/{pid.strip()}/cmdline", root=True).stdout.split("\0")
