"""Debian's prometheus and prometheus-blackbox-exporter watch the shared converged lab
(conftest's converged_lab: node1 orchestrator, node2 and node3 workers), as `meshdeploy
prometheus` configures them.

Both run on the control machine inside the lab's own network namespace (address 10.200.0.1, the
scraper the cluster file names), never as services of the machine. For the test the cluster's
llama-server listens on node1's address with an API key; the cluster file is put back as it was
and applied again at the end, whatever happened.

What it shows: Prometheus scrapes llama-server's /metrics with the key from its credentials file;
the recorded generation rate is that of the completion the test sent (llama-server's own
timings); an rpc-server in use answers no probe once two closed probes wait in its accept queue
(a SYN dropped: the probe times out), and the rule still counts it up while its host answers;
llama-server keeps its connection to each worker through all of it; a stopped rpc-server
refuses, and counts down.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from support.cli import meshdeploy
from support.require import require

from meshdeploy.errors import OK

pytestmark = [pytest.mark.lab, pytest.mark.build]

KEY_DIR = "/etc/meshdeploy-prometheus-test"
KEY = "prometheus-lab-test-key"
PROMETHEUS = "127.0.0.1:19090"  # inside the lab's namespace: nothing outside reaches it
BLACKBOX = "127.0.0.1:19115"
WAIT = 180  # seconds any one condition may take before the test fails


def watched(text: str, scraper: str) -> str:
    """The converged lab's file with main on node1's address, behind a key, and the scraper."""
    for old, new in (("    bind: 127.0.0.1\n",
                      f"    bind: 10.200.0.11\n    api_key_file: {KEY_DIR}/main.key\n"),
                     ("hosts:\n", f"monitoring:\n  scrapers: [{scraper}]\nhosts:\n")):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


class Lab:
    """Prometheus's HTTP API, asked from inside the lab's namespace."""

    def __init__(self, netns: str):
        self.netns = netns

    def query(self, expr: str) -> list[dict]:
        done = subprocess.run(["ip", "netns", "exec", self.netns, "curl", "-s", "-m", "10",
                               "--get", f"http://{PROMETHEUS}/api/v1/query",
                               "--data-urlencode", f"query={expr}"],
                              capture_output=True, text=True, timeout=30)
        try:
            answer = json.loads(done.stdout)
        except ValueError:
            return []
        return answer.get("data", {}).get("result", []) if answer.get("status") == "success" \
            else []

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if len(result) == 1 else None

    def wait(self, what: str, expr: str, ok) -> float | list:
        """The query's answer once ok(answer) holds; fails after WAIT seconds, saying `what`."""
        deadline = time.monotonic() + WAIT
        while True:
            answer = self.query(expr)
            if ok(answer):
                return answer
            assert time.monotonic() < deadline, f"{what}: {expr} still gives {answer}"
            time.sleep(2)


def values(answer: list[dict]) -> dict[str, float]:
    return {r["metric"].get("host", ""): float(r["value"][1]) for r in answer}


@contextmanager
def running(argv: list[str], log: Path):
    """A process of this test's own in the lab's namespace; stopped by its pid afterwards."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


def clients(info, host: str) -> list[str]:
    """The peers of the connections established to a worker's rpc-server."""
    out = info.run(host, "ss -Htn state established '( sport = :50052 )'", check=True).stdout
    return sorted(line.split()[-1] for line in out.splitlines() if line.strip())


def complete(info, tokens: int) -> dict:
    """One completion through node1's llama-server, with the key: its timings."""
    body = json.dumps({"prompt": "Count slowly:", "n_predict": tokens, "temperature": 0,
                       "ignore_eos": True, "cache_prompt": False})
    cmd = (f'printf "Authorization: Bearer %s\\n" "$(cat {KEY_DIR}/main.key)" | '
           f"curl -s -m 300 -H @- -H 'Content-Type: application/json' "
           f"http://10.200.0.11:8080/completion -d {shlex.quote(body)}")
    done = info.run("node1", cmd, root=True, timeout=400)
    answer = json.loads(done.stdout)
    return answer["timings"]


def test_prometheus_watches_the_converged_lab(converged_lab, tmp_path):
    require("prometheus", "prometheus-blackbox-exporter", "promtool", "curl")
    info, _, cluster = converged_lab
    netns = info.name  # the lab's namespace holds its bridge: the scraper's address
    original = Path(cluster).read_text()
    info.run("node1", f"install -d -m 0700 {KEY_DIR} && umask 077 && "
                      f"printf %s {KEY} > {KEY_DIR}/main.key", root=True, check=True)
    try:
        Path(cluster).write_text(watched(original, info.bridge_address))
        applied = meshdeploy("apply", cluster, "--auto-approve")
        assert applied.returncode == OK, applied.stdout + applied.stderr
        watch(info, netns, cluster, tmp_path)
    finally:
        info.run("node2", "systemctl start meshdeploy-rpc-50052", root=True)
        Path(cluster).write_text(original)
        restored = meshdeploy("apply", cluster, "--auto-approve")
        info.run("node1", f"rm -rf {KEY_DIR}", root=True)
    assert restored.returncode == OK, restored.stdout + restored.stderr
    plan = meshdeploy("plan", cluster)
    assert plan.stdout.rstrip().endswith("No changes. The cluster matches the configuration.")


def watch(info, netns: str, cluster, tmp_path: Path) -> None:
    out = tmp_path / "prometheus"
    wrote = meshdeploy("prometheus", cluster, "--out", out, "--interval", "5",
                       "--blackbox", BLACKBOX, "--json")
    assert wrote.returncode == OK, wrote.stderr
    (key,) = json.loads(wrote.stdout)["key_files"]
    keys = out / "keys"
    keys.mkdir(mode=0o700)
    (keys / "main").write_text(KEY)
    (keys / "main").chmod(0o600)
    assert Path(key["path"]) == keys / "main"
    checked = subprocess.run(["promtool", "check", "config", str(out / "prometheus.yml")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    api = Lab(netns)
    ns = ["ip", "netns", "exec", netns]
    with running(ns + ["prometheus-blackbox-exporter", f"--config.file={out / 'blackbox.yml'}",
                       f"--web.listen-address={BLACKBOX}"], tmp_path / "blackbox.log"), \
            running(ns + ["prometheus", f"--config.file={out / 'prometheus.yml'}",
                          f"--storage.tsdb.path={tmp_path / 'data'}",
                          f"--web.listen-address={PROMETHEUS}"], tmp_path / "prometheus.log"):
        held = {w: clients(info, w) for w in ("node2", "node3")}
        assert all(held.values()), f"llama-server holds a connection to each worker: {held}"
        # The key works: llama-server answers /metrics to Prometheus (a wrong key gives 401 and
        # up 0), and its counter has a first sample before the completion.
        api.wait("llama-server scraped with its key", 'up{job="meshdeploy-llama-server"}',
                 lambda a: values(a) == {"node1": 1.0})
        api.wait("the counter sampled twice",
                 'count_over_time(llamacpp:tokens_predicted_total[1m])',
                 lambda a: a and float(a[0]["value"][1]) >= 2)

        # Each worker's rpc-server is in use: two probes wait in its accept queue, the next ones
        # time out (SYN dropped), and the rule counts it up all along.
        busy = api.wait("a probe of a worker in use timing out",
                        'probe_success{job="meshdeploy-rpc-server"} == 0 and '
                        'probe_duration_seconds{job="meshdeploy-rpc-server"} >= 1',
                        lambda a: len(a) == 2)
        print(f"probes timing out while llama-server holds the workers: {values(busy)}")
        assert values(api.query("meshdeploy:rpc_server_up")) == {"node2": 1.0, "node3": 1.0}
        assert api.value("meshdeploy:workers_up") == 2.0

        timings = complete(info, 48)
        assert timings["predicted_n"] == 48
        rate = api.wait("the completion's generation rate recorded",
                        'meshdeploy:generation_tokens_per_second:5m{server="main"}',
                        lambda a: len(a) == 1)
        recorded = float(rate[0]["value"][1])
        print(f"generation: {timings['predicted_per_second']:.2f} tok/s from llama-server's "
              f"timings, {recorded:.2f} recorded by Prometheus")
        assert recorded == pytest.approx(timings["predicted_per_second"], rel=0.05)
        assert api.value('meshdeploy:generated_tokens:rate5m{server="main"}') > 0
        # Probing never touched llama-server's own connections.
        assert {w: clients(info, w) for w in held} == held

        info.run("node2", "systemctl stop meshdeploy-rpc-50052", root=True, check=True)
        api.wait("node2 counted down once its rpc-server stopped", "meshdeploy:rpc_server_up",
                 lambda a: values(a) == {"node2": 0.0, "node3": 1.0})
        assert api.value("meshdeploy:workers_up") == 1.0
        assert api.value("meshdeploy:workers") == 2.0
        info.run("node2", "systemctl start meshdeploy-rpc-50052", root=True, check=True)
        api.wait("node2 counted up again", "meshdeploy:rpc_server_up",
                 lambda a: values(a) == {"node2": 1.0, "node3": 1.0})
