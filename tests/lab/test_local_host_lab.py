"""A cluster whose orchestrator is the machine meshdeploy runs on (`connection: local`).

The lab's control machine must not become a cluster host (apply would install units on it), so
meshdeploy itself runs inside a lab host: on its own lab `mdlc`, node1 gets a copy of
meshdeploy (the source tree and its runtime packages from this checkout's virtualenv, on
PYTHONPATH), an SSH key and an ssh_config for node2. As the unprivileged user deploy (so the
local host goes through sudo), node1 plans and applies a cluster of itself (`connection: local`,
orchestrator) and node2 (over SSH, rpc-server). Checked: the cluster serves a chat completion
through the worker, node1 was never reached over SSH, the next plan says "No changes", status,
logs, exec and bench work for the local host, and destroy removes what apply put on both.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import time
from importlib import metadata
from pathlib import Path

import pytest
from conftest import own_lab
from support.labfile import DEFAULT_HF_API, DEFAULT_SSH_CONFIG

pytestmark = [pytest.mark.lab, pytest.mark.build]

LAB_NAME = "mdlc"
REPO = Path(__file__).resolve().parents[2]
OPT = "/opt/md"  # where node1 holds meshdeploy: src/ and site-packages/
HOME = "/home/deploy"
FOLDER = f"{HOME}/cluster"
LINE = re.compile(r"^(\S+) (\S+) +\| \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} ")

SSH_CONFIG = f"""\
Host node2
    HostName 10.200.0.12
    User deploy
    IdentityFile {HOME}/.ssh/lab_key
    IdentitiesOnly yes
    StrictHostKeyChecking accept-new
    UserKnownHostsFile {HOME}/.ssh/known_hosts
"""


def runtime_distributions() -> list[metadata.Distribution]:
    """meshdeploy's runtime requirements, transitively (no test tools, no extras)."""
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    todo = list(metadata.requires("meshdeploy") or [])
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        dist = metadata.distribution(req.name)
        key = dist.metadata["Name"].lower()
        if key not in seen:
            seen[key] = dist
            todo += dist.requires or []
    return list(seen.values())


def install_meshdeploy(root: Path) -> int:
    """Copy meshdeploy and its runtime packages into a host's root; returns the bytes copied."""
    src = root / OPT.lstrip("/") / "src"
    shutil.rmtree(root / OPT.lstrip("/"), ignore_errors=True)
    shutil.copytree(REPO / "meshdeploy", src / "meshdeploy",
                    ignore=shutil.ignore_patterns("__pycache__"))
    site = root / OPT.lstrip("/") / "site-packages"
    copied = 0
    for dist in runtime_distributions():
        for f in dist.files or []:
            if f.parts[0] == ".." or "__pycache__" in f.parts:
                continue  # scripts in the virtualenv's bin/, byte code
            source = Path(dist.locate_file(f))
            target = site / f
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            copied += source.stat().st_size
    return copied


def cluster_file() -> str:
    """inventories/lab.yaml as node1 runs it: node1 local, node2 over SSH through node1's own
    ssh_config, no node3; the Hugging Face mirror at the address the hosts reach it on."""
    text = (REPO / "inventories" / "lab.yaml").read_text()
    edits = [(f"    ssh: {{user: deploy, config: {DEFAULT_SSH_CONFIG}, sudo: true}}\n"
              "    backend: cpu\n  node2:", "    connection: local\n    backend: cpu\n  node2:"),
             (DEFAULT_SSH_CONFIG, f"{FOLDER}/ssh_config"),
             (text[text.index("  node3:\n"):text.index("models:\n")], ""),
             # api_endpoint defaults to the endpoint: node1 reaches the mirror as hosts do
             (next((line + "\n" for line in text.splitlines()
                    if line.startswith(f"  api_endpoint: {DEFAULT_HF_API} ")), "-"), "")]
    for old, new in edits:
        assert old in text, f"inventories/lab.yaml changed: no {old!r}"
        text = text.replace(old, new, 1)
    return text


def write_owned(path: Path, text: str, owner: tuple[int, int], mode: int = 0o644) -> None:
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    os.chown(path, *owner)
    os.chown(path.parent, *owner)


def md(info, *args, timeout: float = 600):
    """meshdeploy run inside node1 as deploy, in the cluster's folder."""
    command = (f"cd {FOLDER} && PYTHONPATH={OPT}/src:{OPT}/site-packages "
               f"python3 -m meshdeploy {shlex.join(args)}")
    started = time.monotonic()
    proc = info.run("node1", command, timeout=timeout)
    print(f"node1$ meshdeploy {' '.join(args)} -> {proc.returncode} in "
          f"{time.monotonic() - started:.1f} s")
    print(proc.stdout[-5000:])
    print(proc.stderr[-3000:])
    return proc


@pytest.fixture(scope="module")
def lc_lab(lab_available, request):
    with own_lab(request, LAB_NAME, hosts=2, toolchain=True) as both:
        yield both


@pytest.fixture(scope="module")
def node1(lc_lab):
    """node1 with meshdeploy, a key and an ssh_config for node2, and the cluster file."""
    from meshdeploy.lab import hosts

    info, _ = lc_lab
    root = hosts.host_dir(Path(info.state_dir), "node1") / "root"
    copied = install_meshdeploy(root)
    print(f"copied meshdeploy and {copied / 1e6:.0f} MB of packages into node1")
    deploy = hosts._account(root, "deploy")[:2]
    home = root / HOME.lstrip("/")
    write_owned(home / ".ssh" / "lab_key", Path(info.ssh["key"]).read_text(), deploy, 0o600)
    write_owned(home / "cluster" / "ssh_config", SSH_CONFIG, deploy)
    write_owned(home / "cluster" / "lab.yaml", cluster_file(), deploy)
    compiled = info.run("node1", f"sudo python3 -m compileall -q {OPT} >/dev/null; "
                                 "python3 --version", timeout=300)
    assert compiled.returncode == 0, compiled.stderr
    print(f"node1: {compiled.stdout.strip()}")
    return info


@pytest.fixture(scope="module")
def applied(node1):
    validated = md(node1, "validate", "lab.yaml")
    assert validated.returncode == 0, validated.stderr
    first = md(node1, "plan", "lab.yaml", "--json")
    assert first.returncode == 0, first.stderr
    plan = json.loads(first.stdout)
    assert plan["local_host"] == "node1" and plan["has_changes"]
    assert {c["host"] for c in plan["changes"] if c["action"] == "create"} == {"node1", "node2"}
    proc = md(node1, "apply", "lab.yaml", "--auto-approve", timeout=1800)
    assert proc.returncode == 0, proc.stderr
    return node1


def test_the_cluster_serves_a_chat_completion_through_the_worker(applied):
    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 16, "temperature": 0, "seed": 1})
    proc = applied.run("node1", "curl -sf http://127.0.0.1:8080/v1/chat/completions "
                                f"-H 'Content-Type: application/json' -d '{body}'")
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["usage"]["completion_tokens"] > 0
    assert answer["choices"][0]["message"]["content"].strip()
    # llama-server's own argv (md-failover, the unit's main process, starts it).
    argv = applied.run("node1", "ps -ww -o args= -C llama-server")
    assert "--rpc 10.200.0.12:50052" in argv.stdout, argv.stdout
    # node2's rpc-server holds the connection of node1's llama-server.
    peers = applied.run("node2", "ss -Htn state established '( sport = :50052 )'").stdout
    assert "10.200.0.11:" in peers, peers


def test_node1_was_never_reached_over_ssh_by_meshdeploy(applied):
    # Every SSH login to node1 comes from the control machine (the tests' own commands), over
    # the ProxyCommand into node1's namespace: from 127.0.0.1. One from node1's own address
    # would be meshdeploy reaching itself over SSH.
    logins = applied.run("node1", "sudo journalctl -u ssh --no-pager -o cat | "
                                  "grep 'Accepted publickey' || true").stdout.splitlines()
    assert logins and all(" from 127.0.0.1 " in line for line in logins), logins
    logins = applied.run("node2", "sudo journalctl -u ssh --no-pager -o cat | "
                                  "grep 'Accepted publickey' || true").stdout
    assert " from 10.200.0.11 " in logins  # node2 is reached over SSH, from node1


def test_the_next_plan_says_no_changes_and_that_node1_is_local(applied):
    proc = md(applied, "plan", "lab.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "No changes. The cluster matches the configuration." in proc.stdout
    assert ("node1 is this machine (connection: local): its commands run here, not over SSH, "
            "so no host-key policy applies to it.") in proc.stdout


def test_status_of_the_local_orchestrator(applied):
    proc = md(applied, "status", "lab.yaml", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = {(r["host"], r["service"]): r for r in json.loads(proc.stdout)}
    # md-failover supervises llama-server (failover.tolerate 1 by default): its own row says
    # which placement serves.
    assert set(rows) == {("node1", "failover main"), ("node1", "llama-server main"),
                         ("node2", "rpc-server :50052")}
    assert all(r["healthy"] for r in rows.values()), rows
    assert rows[("node1", "llama-server main")]["model"]
    assert rows[("node1", "failover main")]["answer"].startswith("full placement since "), rows


def test_logs_and_exec_work_for_the_local_host(applied):
    proc = md(applied, "logs", "lab.yaml", "-n", "20")
    assert proc.returncode == 0, proc.stderr
    services = {m.groups() for m in map(LINE.match, proc.stdout.splitlines()) if m}
    assert services == {("node1", "llama-server:main"), ("node2", "rpc-server:50052")}, \
        proc.stdout
    proc = md(applied, "logs", "lab.yaml", "node1", "-n", "50")
    assert proc.returncode == 0, proc.stderr
    lines = [LINE.match(line) for line in proc.stdout.splitlines()]
    assert lines and all(m and m.groups() == ("node1", "llama-server:main") for m in lines), \
        proc.stdout

    proc = md(applied, "exec", "lab.yaml", "--", "echo $(hostname) $(id -un)")
    assert proc.returncode == 0, proc.stderr
    assert "node1 deploy" in proc.stdout and "node2 deploy" in proc.stdout
    proc = md(applied, "exec", "lab.yaml", "--sudo", "--", "id -u")
    assert proc.returncode == 0, proc.stderr
    assert re.findall(r"^== (\S+) \(exit 0.*\n0$", proc.stdout, re.M) == ["node1", "node2"]
    proc = md(applied, "exec", "lab.yaml", "--limit", "node1", "--", "exit 3")
    assert proc.returncode == 1 and re.search(r"^node1 +3 ", proc.stdout, re.M), proc.stdout


def test_bench_reaches_the_local_orchestrators_api(applied):
    proc = md(applied, "bench", "lab.yaml", "--runs", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    (server,) = json.loads(proc.stdout)["servers"]
    assert server["host"] == "node1"
    assert server["overall"]["tg"]["median"] > 0 and server["overall"]["pp"]["median"] > 0


def test_destroy_removes_what_apply_put_on_both_hosts(applied):
    units = "ls /etc/systemd/system | grep -c '^meshdeploy-' || true"
    assert [applied.run(h, units).stdout.strip() for h in ("node1", "node2")] != ["0", "0"]
    proc = md(applied, "destroy", "lab.yaml", "--auto-approve", timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert [applied.run(h, units).stdout.strip() for h in ("node1", "node2")] == ["0", "0"]
    down = applied.run("node1", "curl -s -o /dev/null -w '%{http_code}' "
                                "http://127.0.0.1:8080/health || true").stdout
    assert down in ("000", ""), down
