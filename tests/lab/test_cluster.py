"""End to end on the lab: validate -> plan -> apply -> chat -> no-op plan -> status.

Three real hosts (orchestrator node1, CPU workers node2 and node3), llama.cpp from the lab's git
mirror at a tag, the gemma GGUF from the lab's Hugging Face mirror. The build runs once per lab
(shared ccache, serial build); later tests in this module reuse the converged cluster.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.labfile import write_lab_file
from support.cli import meshdeploy

pytestmark = [pytest.mark.lab, pytest.mark.build]


REPO = Path(__file__).resolve().parents[2]



@pytest.fixture(scope="module")
def cluster_file(lab, tmp_path_factory):
    """The lab inventory, copied so its lock file lands in a temporary folder."""
    return write_lab_file(lab, tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="module")
def converged(cluster_file):
    first_plan = meshdeploy("plan", cluster_file, "--detailed-exitcode")
    assert first_plan.returncode in (0, 2), first_plan.stderr
    applied = meshdeploy("apply", cluster_file, "--auto-approve")
    assert applied.returncode == 0, applied.stderr
    return {"plan": first_plan, "apply": applied}



def test_validate(cluster_file):
    proc = meshdeploy("validate", cluster_file)
    assert proc.returncode == 0, proc.stderr
    assert "3 hosts, 2 rpc-servers, 1 model" in proc.stdout


def test_first_plan_creates_everything(converged):
    if converged["plan"].returncode == 0:
        pytest.skip("the lab was already converged (reused with --keep-lab)")
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
    # Layers (and so weights) live on the remote workers: each worker's rpc-server holds far
    # more memory than an idle one started beside it for comparison.
    for worker in ("node2", "node3"):
        pid = lab.run(worker, "systemctl show -p MainPID --value meshdeploy-rpc-50052").stdout.strip()
        loaded = rss_kib(lab, worker, pid)
        idle = lab.run(worker, "sudo sh -c '/opt/meshdeploy/current/bin/ggml-rpc-server -H 127.0.0.1 "
                               "-p 50099 >/dev/null 2>&1 & p=$!; sleep 1.5; "
                               "grep VmRSS /proc/$p/status; kill $p'").stdout.split()[1]
        print(f"{worker}: rpc-server RSS {loaded} KiB serving, {idle} KiB idle")
        assert loaded > 4 * int(idle) and loaded > 20 * 1024, (worker, loaded, idle)


def rss_kib(lab, host: str, pid: str) -> int:
    return int(lab.run(host, f"grep VmRSS /proc/{pid}/status").stdout.split()[1])


def test_second_plan_is_empty(converged, cluster_file):
    proc = meshdeploy("plan", cluster_file, "--detailed-exitcode")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("No changes. The cluster matches the configuration.")


def test_plan_json_counts_remote_commands(converged, cluster_file):
    proc = meshdeploy("plan", cluster_file, "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["counts"] == {"add": 0, "change": 0, "destroy": 0}
    # The headline figure: one batched probe per host on a no-op plan.
    assert data["remote_commands"] == {"node1": 1, "node2": 1, "node3": 1}
    assert [p["server"] for p in data["placement"]] == ["main"]
    assert {e["host"] for n in data["network"] for e in n["endpoints"]} == {"node2", "node3"}


def test_status_all_healthy(converged, cluster_file, lab):
    body = json.dumps({"prompt": "One, two,", "n_predict": 8, "temperature": 0})
    done = lab.run("node1", "curl -sf http://127.0.0.1:8080/completion "
                            f"-H 'Content-Type: application/json' -d '{body}'")
    assert done.returncode == 0, done.stderr
    proc = meshdeploy("status", cluster_file, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout)
    services = {(r["host"], r["service"]) for r in rows}
    assert {("node1", "llama-server main"), ("node2", "rpc-server :50052"),
            ("node3", "rpc-server :50052")} <= services
    assert all(r["healthy"] for r in rows)
    server = next(r for r in rows if r["service"] == "llama-server main")
    assert server["model"] and "gemma" in server["model"]
    # From llama-server's own /metrics: the tokens generated since it started, at a rate.
    assert server["generated"] >= 8 and server["gen_tps"] > 0, server


def test_a_pyinfra_deploy_reuses_two_roles(converged, cluster_file, lab, tmp_path):
    """docs/examples/deploy.py through pyinfra's own CLI: a stopped rpc-server is started again,
    and pyinfra names the operations as the registry does; meshdeploy's next plan restarts the
    llama-server that used it."""
    unit = "meshdeploy-rpc-50052"
    lab.run("node2", f"sudo systemctl stop {unit}", check=True)
    assert lab.run("node2", f"systemctl is-active {unit}").stdout.strip() != "active"
    inventory = tmp_path / "inventory.py"
    known_hosts = tmp_path / "known_hosts"  # pyinfra records the lab's host key here
    inventory.write_text(f"hosts = [('node2', {{'ssh_config_file': {lab.ssh['config']!r}, "
                         f"'ssh_user': 'deploy', 'ssh_known_hosts_file': {str(known_hosts)!r}}})]\n")
    pyinfra = Path(sys.executable).with_name("pyinfra")
    proc = subprocess.run([str(pyinfra), str(inventory), str(REPO / "docs/examples/deploy.py"),
                           "--sudo", "-y", "--data", f"meshdeploy_cluster={cluster_file}"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          stdin=subprocess.DEVNULL)
    print(proc.stdout[-6000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr  # pyinfra reports on stderr
    assert "Starting operation: services.rpc_server (50052" in said
    assert "Starting operation: toolchain.packages" in said
    assert lab.run("node2", f"systemctl is-active {unit}").stdout.strip() == "active"
    # meshdeploy agrees on node2, and sees what the deploy of one host could not: node1's
    # llama-server still holds its connection to the rpc-server that was stopped, so its next
    # request would abort. The apply restarts it; then nothing is left to do.
    plan = meshdeploy("plan", cluster_file)
    assert "workers restarted after it hold no connection from it (node2:50052)" in plan.stdout
    assert "node2/services" not in plan.stdout, plan.stdout
    assert meshdeploy("apply", cluster_file, "--auto-approve").returncode == 0
    assert meshdeploy("plan", cluster_file, "--detailed-exitcode").returncode == 0


def tcp_probe(lab, client: str, address: str, port: int) -> str:
    """"open" when `client` completes a TCP handshake with address:port within 3 s.

    rpc-server serves one client at a time with a backlog of 1: while llama-server holds its
    connection, a probe that gets in waits in the accept queue and, two probes later, the queue
    drops SYNs like a firewall would. An "open" probe of an rpc port is taken with the
    orchestrator stopped (`idle_workers`); a "shut" one never reaches the queue."""
    probe = (f"timeout 3 bash -c 'exec 3<>/dev/tcp/{address}/{port}' && echo open || echo shut")
    return lab.run(client, probe).stdout.strip()


@contextlib.contextmanager
def idle_workers(lab):
    """node1's llama-server stopped, so every rpc-server accepts (and drains its queue)."""
    lab.run("node1", "sudo systemctl stop meshdeploy-server-main", check=True)
    try:
        yield
    finally:
        lab.run("node1", "sudo systemctl start meshdeploy-server-main", check=True)
        healthy = lab.run("node1", "for i in $(seq 120); do for a in 127.0.0.1 10.200.0.11; do "
                                   "curl -sf -m 2 http://$a:8080/health >/dev/null && exit 0; "
                                   "done; sleep 1; done; exit 1", timeout=300)
        assert healthy.returncode == 0, "llama-server did not come back after the probes"


def test_rpc_port_is_open_only_to_its_orchestrator(converged, cluster_file, lab):
    """network.allowlist: node3 is in the cluster but no llama-server there uses node2's
    rpc-server, so it is refused like any other host; node1 (the orchestrator) gets in. The
    same connection succeeds once the table is gone (the check can fail), and the plan calls
    the hand-deleted table drift that apply repairs."""
    with idle_workers(lab):
        assert tcp_probe(lab, "node1", "10.200.0.12", 50052) == "open"
        assert tcp_probe(lab, "node3", "10.200.0.12", 50052) == "shut"
        lab.run("node2", "sudo nft delete table inet meshdeploy", check=True)
        assert tcp_probe(lab, "node3", "10.200.0.12", 50052) == "open"
    plan = meshdeploy("plan", cluster_file, "--json")
    changed = [c["address"] for c in json.loads(plan.stdout)["changes"] if c["action"] != "no-op"]
    assert changed == ["node2/network.allowlist"]
    assert meshdeploy("apply", cluster_file, "--auto-approve").returncode == 0
    with idle_workers(lab):
        assert tcp_probe(lab, "node3", "10.200.0.12", 50052) == "shut"
        assert tcp_probe(lab, "node1", "10.200.0.12", 50052) == "open"
    assert meshdeploy("plan", cluster_file, "--detailed-exitcode").returncode == 0


def chat(lab, client: str, url: str, key: str | None) -> subprocess.CompletedProcess:
    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 8, "temperature": 0, "seed": 1})
    auth = f"-H 'Authorization: Bearer {key}' " if key else ""
    return lab.run(client, f"curl -s -m 60 -o /dev/null -w '%{{http_code}}' {auth}"
                           f"-H 'Content-Type: application/json' -d '{body}' "
                           f"{url}/v1/chat/completions")


def test_a_rogue_host_reaches_no_port_and_allowed_clients_are_served(converged, cluster_file,
                                                                    lab):
    """A lab host in no cluster file (node4) against a cluster whose llama-server is served to
    the network for node3 only (servers.main.allow). With the tables deleted by hand the rogue
    host reaches every worker and the llama-server (so the check can fail); after apply it
    reaches none of them, while node3 is still served chat completions through the workers."""
    rogue = lab.rogue[0]
    key = "lab-key-4c1f"
    url = "http://10.200.0.11:8080"
    lab.run("node1", "sudo install -d -m 755 /etc/meshdeploy && sudo sh -c "
                     f"'umask 077; printf %s {key} > /etc/meshdeploy/api-key'", check=True)
    served = variant(cluster_file, "served.yaml", "    bind: 127.0.0.1\n",
                     "    bind: 10.200.0.11\n    allow: [10.200.0.13]\n"
                     "    api_key_file: /etc/meshdeploy/api-key\n")
    workers = [("10.200.0.12", 50052), ("10.200.0.13", 50052)]
    try:
        assert meshdeploy("apply", served, "--auto-approve").returncode == 0
        for host in ("node1", "node2", "node3"):
            lab.run(host, "sudo nft delete table inet meshdeploy", check=True)
        assert tcp_probe(lab, rogue, "10.200.0.11", 8080) == "open"
        with idle_workers(lab):
            assert [tcp_probe(lab, rogue, *w) for w in workers] == ["open", "open"]
        plan = meshdeploy("plan", served, "--json")
        changed = [c["address"] for c in json.loads(plan.stdout)["changes"]
                   if c["action"] != "no-op"]
        assert changed == [f"{h}/network.allowlist" for h in ("node1", "node2", "node3")]
        assert meshdeploy("apply", served, "--auto-approve").returncode == 0
        assert tcp_probe(lab, rogue, "10.200.0.11", 8080) == "shut"
        assert [tcp_probe(lab, rogue, *w) for w in workers] == ["shut", "shut"]
        assert chat(lab, "node3", url, key).stdout == "200"
        assert chat(lab, "node3", url, None).stdout == "401"
        assert meshdeploy("plan", served, "--detailed-exitcode").returncode == 0
    finally:
        back = meshdeploy("apply", cluster_file, "--auto-approve")
        lab.run("node1", "sudo rm -f /etc/meshdeploy/api-key")
    assert back.returncode == 0, back.stderr


def test_a_worker_left_out_of_rpc_loses_its_orchestrators_entry(converged, cluster_file, lab):
    """main stops using node3's rpc-server: node3's allow-list drops node1 in the same apply
    that restarts main, and node1 can no longer reach it; putting it back restores both."""
    with idle_workers(lab):
        assert tcp_probe(lab, "node1", "10.200.0.13", 50052) == "open"
    fewer = variant(cluster_file, "fewer.yaml", "    ctx_size: 2048\n",
                    "    ctx_size: 2048\n    rpc: [node2:50052]\n")
    try:
        plan = meshdeploy("plan", fewer, "--json")
        data = json.loads(plan.stdout)
        changes = {c["address"]: c for c in data["changes"] if c["action"] != "no-op"}
        assert set(changes) >= {"node3/network.allowlist", "node1/services.llama_server[main]"}
        [diff] = changes["node3/network.allowlist"]["diffs"]
        assert (diff["before"], diff["after"]) == ("lo 10.200.0.11", "lo")
        assert meshdeploy("apply", fewer, "--auto-approve").returncode == 0
        assert tcp_probe(lab, "node1", "10.200.0.13", 50052) == "shut"
        with idle_workers(lab):
            assert tcp_probe(lab, "node1", "10.200.0.12", 50052) == "open"
    finally:
        back = meshdeploy("apply", cluster_file, "--auto-approve")
    assert back.returncode == 0, back.stderr
    with idle_workers(lab):
        assert tcp_probe(lab, "node1", "10.200.0.13", 50052) == "open"


def test_a_host_without_nftables_gets_it_and_its_table(converged, cluster_file, lab):
    """The nftables package removed by hand: the plan no longer sees the table (nothing can
    list it), apply installs the package (through the lab's apt proxy) and loads the table."""
    lab.run("node3", "sudo env DEBIAN_FRONTEND=noninteractive apt-get remove -y -qq nftables",
            check=True)
    plan = meshdeploy("plan", cluster_file, "--json")
    changed = [c["address"] for c in json.loads(plan.stdout)["changes"] if c["action"] != "no-op"]
    assert changed == ["node3/network.allowlist"]
    assert meshdeploy("apply", cluster_file, "--auto-approve").returncode == 0
    assert lab.run("node3", "sudo nft list table inet meshdeploy").returncode == 0
    assert meshdeploy("plan", cluster_file, "--detailed-exitcode").returncode == 0


def test_target_applies_the_allowlist_and_leaves_the_rest(converged, cluster_file, lab):
    """Two drifts on node3 (its table deleted, its rpc-server stopped): -target applies the
    allow-list and what it needs only; the next whole plan still shows the server, and says
    nothing of the table."""
    lab.run("node3", "sudo nft delete table inet meshdeploy", check=True)
    lab.run("node3", "sudo systemctl stop meshdeploy-rpc-50052", check=True)
    try:
        part = meshdeploy("plan", cluster_file, "--json", "-target=node3/network.allowlist")
        assert part.returncode == 0, part.stderr
        planned = json.loads(part.stdout)
        assert [c["address"] for c in planned["changes"] if c["action"] != "no-op"] == [
            "node3/network.allowlist"]
        assert {c["host"] for c in planned["changes"]} == {"node3"}
        assert any(w.startswith("-target=node3/network.allowlist: 2 of ")
                   for w in planned["warnings"])
        done = meshdeploy("apply", cluster_file, "--auto-approve",
                          "-target=node3/network.allowlist")
        assert done.returncode == 0, done.stderr
        assert lab.run("node3", "sudo nft list table inet meshdeploy").returncode == 0
        assert lab.run("node3", "systemctl is-active meshdeploy-rpc-50052").stdout.strip() \
            != "active"
        rest = json.loads(meshdeploy("plan", cluster_file, "--json").stdout)["changes"]
        left = [c["address"] for c in rest if c["action"] != "no-op"]
        # The server restarts with its worker: that is the rest, the table is not.
        assert left == ["node3/services.rpc_server[50052]", "node1/services.llama_server[main]"]
    finally:
        fixed = meshdeploy("apply", cluster_file, "--auto-approve")
        assert fixed.returncode == 0, fixed.stderr


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


def test_sudo_refused_is_one_clear_error(converged, cluster_file, tmp_path, lab):
    lab.run("node3", "sudo sh -c 'id nosudo >/dev/null 2>&1 || useradd -m -s /bin/sh nosudo; "
                     "mkdir -p ~nosudo/.ssh && cp ~deploy/.ssh/authorized_keys ~nosudo/.ssh/ && "
                     "chown -R nosudo: ~nosudo/.ssh'", check=True)
    text = cluster_file.read_text()
    node3 = text.index("  node3:")
    text = text[:node3] + text[node3:].replace("user: deploy", "user: nosudo", 1)
    bad = tmp_path / "nosudo.yaml"
    bad.write_text(text)
    proc = meshdeploy("plan", bad)
    assert proc.returncode == 4, proc.stderr
    assert "node3: sudo refused for user nosudo" in proc.stderr
    assert "passwordless sudo" in proc.stderr and "Traceback" not in proc.stderr


# --- roles in depth ---------------------------------------------------------------------------

GEMMA = "/opt/meshdeploy/models/gemma/gemma-3-270m-q4_k_m.gguf"
GEMMA_SIZE = 253113024
GEMMA_SHA = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def variant(cluster_file: Path, name: str, old: str, new: str) -> Path:
    """The cluster file with one edit, beside the original (so it shares the lock file)."""
    text = cluster_file.read_text()
    assert old and old in text, old
    target = cluster_file.with_name(name)
    target.write_text(text.replace(old, new))
    lock = cluster_file.with_name("lab.lock.json")
    if lock.exists():
        target.with_name(target.stem + ".lock.json").write_text(lock.read_text())
    return target


def main_pid(lab, host: str, unit: str) -> str:
    return lab.run(host, f"systemctl show -p MainPID --value {unit}").stdout.strip()


def test_only_what_changed_restarts(converged, cluster_file, lab):
    before = {h: main_pid(lab, h, "meshdeploy-rpc-50052") for h in ("node2", "node3")}
    server_before = main_pid(lab, "node1", "meshdeploy-server-main")
    bigger = variant(cluster_file, "ctx4096.yaml", "ctx_size: 2048", "ctx_size: 4096")
    plan = meshdeploy("plan", bigger, "--json")
    changed = [c["address"] for c in json.loads(plan.stdout)["changes"] if c["action"] != "no-op"]
    assert changed == ["node1/services.llama_server[main]"]
    assert meshdeploy("apply", bigger, "--auto-approve").returncode == 0
    assert {h: main_pid(lab, h, "meshdeploy-rpc-50052") for h in before} == before
    assert main_pid(lab, "node1", "meshdeploy-server-main") != server_before
    back = meshdeploy("apply", cluster_file, "--auto-approve")
    assert back.returncode == 0, back.stderr


def test_a_value_with_spaces_percent_dollar_and_quotes_arrives_intact(converged, cluster_file,
                                                                     lab):
    """A legitimate value is not refused and not mangled: it reaches llama-server's argv as one
    word, through the unit's quoting, %%-specifier and $$-variable escaping."""
    alias = """gemma 50% $HOME ${USER} 'single' "double" `tick` $(id) ; | &"""
    quoted = json.dumps(alias)
    odd = variant(cluster_file, "alias.yaml", "ctx_size: 2048",
                  f"ctx_size: 2048\n    extra_args: [--alias, {quoted}]")
    proc = meshdeploy("apply", odd, "--auto-approve")
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        served = lab.run("node1", "curl -sf http://127.0.0.1:8080/v1/models")
        assert served.returncode == 0, served.stderr
        assert alias in [m["id"] for m in json.loads(served.stdout)["data"]], served.stdout
        again = meshdeploy("plan", odd, "--detailed-exitcode")
        assert again.returncode == 0, again.stdout + again.stderr
    finally:
        back = meshdeploy("apply", cluster_file, "--auto-approve")
        assert back.returncode == 0, back.stderr


def test_cut_download_resumes_and_ends_verified(converged, cluster_file, lab):
    half = GEMMA_SIZE // 2
    lab.run("node1", f"sudo sh -c 'mv {GEMMA} {GEMMA}.part && truncate -s {half} {GEMMA}.part "
                     f"&& rm -f {GEMMA}.meshdeploy-verified'", check=True)
    plan = meshdeploy("plan", cluster_file)
    assert "# node1/models.gguf[gemma] will be created" in plan.stdout
    assert f"{(GEMMA_SIZE - half) / 2**20:.1f} MiB to download" in plan.stdout
    log = Path(lab.state_dir) / "run" / "hf.log"
    mark = log.stat().st_size if log.exists() else 0
    applied = meshdeploy("apply", cluster_file, "--auto-approve")
    assert applied.returncode == 0, applied.stderr
    served = log.read_text()[mark:]
    assert f"range=bytes={half}-" in served, served[-2000:]
    sha = lab.run("node1", f"sha256sum {GEMMA}").stdout.split()[0]
    assert sha == GEMMA_SHA
    assert meshdeploy("plan", cluster_file, "--detailed-exitcode").returncode == 0


def test_corrupted_model_is_detected_and_replaced(converged, cluster_file, lab):
    lab.run("node1", f"printf XXXX | sudo dd of={GEMMA} bs=1 seek=4096 conv=notrunc status=none",
            check=True)
    plan = meshdeploy("plan", cluster_file)
    assert "node1/models.gguf[gemma]" in plan.stdout
    applied = meshdeploy("apply", cluster_file, "--auto-approve")
    assert applied.returncode == 0, applied.stderr
    assert lab.run("node1", f"sha256sum {GEMMA}").stdout.split()[0] == GEMMA_SHA
    assert meshdeploy("plan", cluster_file, "--detailed-exitcode").returncode == 0


def test_ollama_store_is_used_in_place(converged, cluster_file, lab):
    store = "/srv/ollama/models"
    blob = f"{store}/blobs/sha256-{GEMMA_SHA}"
    manifest = json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{GEMMA_SHA}",
         "size": GEMMA_SIZE}]})
    encoded = base64.b64encode(manifest.encode()).decode()
    lab.run("node1", f"sudo sh -c 'mkdir -p {store}/blobs "
                     f"{store}/manifests/registry.ollama.ai/library/gemma3 && cp {GEMMA} {blob} && "
                     f"chmod 644 {blob} && echo {encoded} | base64 -d > "
                     f"{store}/manifests/registry.ollama.ai/library/gemma3/270m'", check=True)
    text = cluster_file.read_text()
    start = text.index("\nmodels:") + 1
    end = text.index("\nservers:") + 1
    ollama = variant(cluster_file, "ollama.yaml", text[start:end],
                     "models:\n  gemma:\n    ollama: {model: \"gemma3:270m\", store: /srv/ollama/models}\n")
    applied = meshdeploy("apply", ollama, "--auto-approve")
    assert applied.returncode == 0, applied.stderr
    link = "/opt/meshdeploy/models/gemma/model.gguf"
    assert lab.run("node1", f"readlink {link}").stdout.strip() == blob
    # One copy on disk: the blob's link count and the store's usage are unchanged by the apply.
    assert lab.run("node1", f"stat -c %h {blob}").stdout.strip() == "1"
    assert meshdeploy("plan", ollama, "--detailed-exitcode").returncode == 0
    status = meshdeploy("status", ollama, "--json")
    assert status.returncode == 0, status.stdout
    back = meshdeploy("apply", cluster_file, "--auto-approve")
    assert back.returncode == 0, back.stderr


def test_pin_change_rebuilds_and_rollback_is_one_apply(converged, cluster_file, lab):
    older = variant(cluster_file, "older.yaml", "ref: b11312", "ref: b10454")
    plan = meshdeploy("plan", older)
    assert "# node1/llama_cpp.build must be replaced" in plan.stdout
    assert "# forces replacement" in plan.stdout
    applied = meshdeploy("apply", older, "--auto-approve")
    assert applied.returncode == 0, applied.stderr
    status = json.loads(meshdeploy("status", older, "--json").stdout)
    assert all(r["healthy"] for r in status)
    assert {r["protocol"] for r in status if r["service"].startswith("rpc-server")} <= {"5.0.0"}
    # Back to the newer pin: its build is still installed, so no compiler runs.
    again = meshdeploy("plan", cluster_file)
    assert "switch to an existing build (no compile)" in again.stdout
    assert "must be replaced" not in again.stdout
    rolled = meshdeploy("apply", cluster_file, "--auto-approve")
    assert rolled.returncode == 0, rolled.stderr
    assert "cmake" not in rolled.stdout
    print(f"pin change apply {applied.seconds:.1f} s; rollback apply {rolled.seconds:.1f} s")
    assert meshdeploy("plan", cluster_file, "--detailed-exitcode").returncode == 0
