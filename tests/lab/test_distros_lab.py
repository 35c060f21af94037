"""One cluster over three Debian releases (lab mdds: node1 Debian 12 bookworm, node2 and node4
Debian 11 bullseye, node3 and node5 Debian 13 trixie; the plain base, so meshdeploy installs
each host's toolchain from its own release).

inventories/lab.yaml with two more workers: node1 runs llama-server, the others one rpc-server
each. Hosts of different releases have different build keys, so each release compiles its own
build (the workers only ggml and the rpc-server target), once: node4 copies node2's, node5
node3's, and gets no build tools. In order: apply converges all five; a chat completion goes
through the workers; the next plan says "No changes"; the first three hosts under
network.transport: wireguard are refused by the plan (node2: no module, no wireguard-go in
Debian 11); destroy leaves no unit or nft table of meshdeploy's on any host. The README's host
support table cites this module.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import own_lab
from support.cli import meshdeploy
from support.labfile import lab_text, write_lab_file

from meshdeploy.core import share
from meshdeploy.lab import hosts

pytestmark = [pytest.mark.lab, pytest.mark.build]

SUITES = {"node1": "bookworm", "node2": "bullseye", "node3": "trixie", "node4": "bullseye",
          "node5": "trixie"}
COPIES = {"node4": "node2", "node5": "node3"}  # copier: the host of its release that compiles
WORKERS = ("node2", "node3", "node4", "node5")
PREFIX = "/opt/meshdeploy"
RELEASES = {"bookworm": "12", "bullseye": "11", "trixie": "13"}
NO_CHANGES = "No changes. The cluster matches the configuration."


@pytest.fixture(scope="module")
def ds_lab(lab_available, request):
    with own_lab(request, "mdds", hosts=5, suites=SUITES) as both:
        yield both


def sh(info, host: str, command: str) -> str:
    done = info.run(host, command, root=True)
    assert done.returncode == 0, f"{host}: {command}: {done.stderr}"
    return done.stdout.strip()


# md-share as the product ships it, run by the host's own python3 (3.9 on Debian 11, 3.13 on
# 13): one byte range of a random file, checked against the file. Before apply the hosts have
# no curl (the plain base): python3 fetches the range.
SHARE_CHECK = r"""
cat > /tmp/md-share.py && head -c 4096 /dev/urandom > /tmp/blob && rm -f /tmp/md-share.pid
python3 /tmp/md-share.py --bind 127.0.0.1 --port 29990 --allow 127.0.0.1 --file blob=/tmp/blob \
    --idle 5 --max 30 --pid-file /tmp/md-share.pid --log /tmp/md-share.log &
for _ in $(seq 100); do [ -s /tmp/md-share.pid ] && break; sleep 0.1; done
python3 -c 'import urllib.request as u, sys; r = u.Request(sys.argv[1], headers={"Range": "bytes=100-1123"})
sys.stdout.buffer.write(u.urlopen(r, timeout=10).read())' http://127.0.0.1:29990/models/blob > /tmp/got
tail -c +101 /tmp/blob | head -c 1024 | cmp - /tmp/got && echo same
python3 --version
"""


def test_md_share_serves_ranges_under_each_releases_python(ds_lab):
    info, _ = ds_lab
    server = (Path(share.__file__).parent / "templates" / "md-share.py").read_bytes()
    for host in SUITES:
        argv = hosts.ssh_argv(Path(info.ssh["config"]), f"root@{host}", SHARE_CHECK,
                              identity=Path(info.ssh["admin_key"]))
        done = subprocess.run(argv, input=server, capture_output=True, timeout=60)
        out = done.stdout.decode()
        assert done.returncode == 0 and out.startswith("same\n"), (host, out, done.stderr)
        print(f"md-share on {host}: {out.split()[-2:]}")


def five_hosts(info) -> str:
    """inventories/lab.yaml with node4 and node5 as workers like node3 (llama-server uses every
    rpc-server of the file)."""
    text = lab_text(info)
    start, end = text.index("  node3:\n"), text.index("\nmodels:\n")
    node3 = text[start:end + 1]
    more = "".join(node3.replace("node3", name).replace(
        info.host("node3").address, info.host(name).address) for name in COPIES)
    return text[:end + 1] + more + text[end + 1:]


@pytest.fixture(scope="module")
def applied(ds_lab, tmp_path_factory):
    info, _ = ds_lab
    path = write_lab_file(info, tmp_path_factory.mktemp("distros"), text=five_hosts(info))
    started = time.monotonic()
    done = meshdeploy("apply", path, "--auto-approve")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    steps = {h: re.findall(rf"{h}\s+(llama_cpp\.build|llama_cpp\.copy|toolchain\.packages)"
                           r"\s+ok \(([0-9.]+) s\)", done.stdout) for h in SUITES}
    print(f"\ndistros figures: apply (converge) {took:.0f} s; " + "; ".join(
        f"{h} ({SUITES[h]}): " + ", ".join(f"{step} {secs} s" for step, secs in steps[h])
        for h in SUITES))
    return info, path, done.stdout


def test_each_host_runs_the_release_it_was_given(ds_lab):
    info, _ = ds_lab
    for host, suite in SUITES.items():
        assert info.host(host).suite == suite
        release = sh(info, host, ". /etc/os-release && echo $VERSION_ID $VERSION_CODENAME")
        assert release == f"{RELEASES[suite]} {suite}", (host, release)


def test_apply_converges_and_each_release_compiles_its_own_build_once(applied):
    info, _, output = applied
    keys = {h: sh(info, h, f"readlink {PREFIX}/current") for h in SUITES}
    assert len(set(keys.values())) == 3, keys  # three releases, three build keys
    for host in WORKERS:
        assert sh(info, host, "systemctl is-active meshdeploy-rpc-50052") == "active"
        built = sh(info, host, f"ls {PREFIX}/current/bin")
        assert built.split() == ["ggml-rpc-server"], (host, built)  # no llama-server compiled
    # node4 and node5 copied the build of their release's other host: the same key and bytes,
    # no compile there (ninja's log and the clone are the builder's alone), no build tools.
    for copier, builder in COPIES.items():
        assert keys[copier] == keys[builder], keys
        assert re.search(rf"(?m)^\s*{copier}\s+llama_cpp\.copy\s+ok", output), output[-3000:]
        logs = {h: sh(info, h, f"ls {PREFIX}/build/*.build.log 2>/dev/null | wc -l")
                for h in (copier, builder)}
        assert logs == {copier: "0", builder: "1"}, logs
        binary = f"{PREFIX}/current/bin/ggml-rpc-server"
        sums = {h: sh(info, h, f"sha256sum {binary} | cut -c1-64") for h in (copier, builder)}
        assert len(set(sums.values())) == 1, sums
        tools = sh(info, copier, "for t in cmake c++ ninja; do command -v $t || echo no-$t; done")
        assert tools.split() == ["no-cmake", "no-c++", "no-ninja"], (copier, tools)
    assert sh(info, "node1", "curl -sf http://127.0.0.1:8080/health") == '{"status":"ok"}'
    # Each worker's nft allow-list (nftables 0.9.8 on 11, 1.1.3 on 13) lets node1 in and
    # drops the other workers.
    reach = "timeout 3 bash -c '</dev/tcp/{}/50052' && echo open || echo closed"
    for source, target in (("node1", "node2"), ("node1", "node3"), ("node1", "node4"),
                           ("node1", "node5"), ("node3", "node2"), ("node2", "node3"),
                           ("node5", "node4")):
        said = sh(info, source, reach.format(info.host(target).address))
        assert said == ("open" if source == "node1" else "closed"), (source, target, said)


def test_a_chat_completion_goes_through_the_workers_of_the_other_releases(applied):
    info, _, output = applied
    body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}],
                       "max_tokens": 16, "temperature": 0, "seed": 1})
    answer = json.loads(sh(info, "node1", "curl -sf http://127.0.0.1:8080/v1/chat/completions "
                                          f"-H 'Content-Type: application/json' -d '{body}'"))
    assert answer["usage"]["completion_tokens"] > 0
    # llama-server on node1 loaded its layers onto every worker: each one's rpc-server holds at
    # least the weights the plan's placement table says it is sent ("wire MB/load", the third
    # figure from the end of its row; an idle rpc-server is a few MiB).
    for host in WORKERS:
        row = re.search(rf"(?m)^{host}:50052/CPU\s.*\s([0-9.]+)\s+[0-9.]+\s+[0-9.]+\s*$", output)
        assert row, output[-3000:]
        sent_kib = float(row.group(1)) * 1e6 / 1024
        pid = sh(info, host, "systemctl show -p MainPID --value meshdeploy-rpc-50052")
        rss = int(sh(info, host, f"awk '/^VmRSS/ {{print $2}}' /proc/{pid}/status"))
        assert rss > sent_kib > 10 * 1024, (host, rss, sent_kib)


def test_the_plan_after_apply_says_no_changes(applied):
    _, path, _ = applied
    again = meshdeploy("plan", path, "--detailed-exitcode")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.strip().endswith(NO_CHANGES), again.stdout


def test_a_tunnel_debian_11_cannot_run_is_refused_by_the_plan_in_one_line(applied, tmp_path):
    # The lab's kernel has no WireGuard module, and Debian 11 has no wireguard-go package:
    # the plan refuses node2 before any change, instead of apt-get failing half way.
    info, _, _ = applied
    path = write_lab_file(info, tmp_path, "lab-wireguard.yaml")
    plan = meshdeploy("plan", path)
    assert plan.returncode != 0 and "Traceback" not in plan.stderr, plan.stdout + plan.stderr
    first = plan.stderr.strip().splitlines()[0]
    assert "node2: the kernel has no WireGuard module and debian 11 has no wireguard-go " \
           "package" in first, plan.stderr
    assert "network.transport: plain" in plan.stderr
    assert "node3" not in plan.stderr  # trixie has wireguard-go: apt-get installs it there


def test_destroy_removes_every_unit_and_table_on_each_release(applied):
    info, path, _ = applied
    done = meshdeploy("destroy", path, "--auto-approve")
    assert done.returncode == 0, done.stdout + done.stderr
    for host in SUITES:
        left = sh(info, host, "ls /etc/systemd/system | grep -c '^meshdeploy-' ; "
                              "systemctl list-units --all --no-legend --plain 'meshdeploy-*' "
                              "| awk '$3 != \"inactive\"' | grep -c . ; "
                              "nft list table inet meshdeploy >/dev/null 2>&1 && echo table "
                              "|| echo none")
        assert left.split() == ["0", "0", "none"], (host, left)
