"""Live progress on a real apply (lab mdpg: node1 orchestrator, node2 worker).

The first apply runs in a pipe: while node1's llama.cpp build runs (ggml's C files compiled for
real: a define of this run's own misses the shared ccache) and node1
downloads the model (the mirror's traffic to node1 shaped to 64 Mbit/s by tc, so it lasts tens
of seconds), plain progress lines come with increasing percentages before each step's `ok`
line. Then the model is removed from node1 and `apply --json` downloads it again: stdout is one
JSON document and carries no progress at all.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import own_lab
from support.labfile import lab_text, without_host

from meshdeploy.core.progress import MARKER
from meshdeploy.lab import hosts

pytestmark = [pytest.mark.lab, pytest.mark.build]

MODEL = "/opt/meshdeploy/models/gemma/gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="module")
def pg_lab(lab_available, request):
    with own_lab(request, "mdpg", hosts=2, toolchain=True) as both:
        yield both


@pytest.fixture(scope="module")
def cluster_file(pg_lab, tmp_path_factory):
    info, _ = pg_lab
    text = without_host(lab_text(info), "node3")
    # The lab's ccache is shared and warm: every compile would hit and the build end in seconds.
    # A header of this run's own, included into every C file, makes ggml's C files miss; the
    # C++ files still hit. A -D define or a warning switch did not: ccache's preprocessor mode
    # hashes the preprocessed text, and a define no source reads leaves it unchanged (the build
    # hit in seconds, no progress line). The header's text differs per host, so the second
    # build misses too instead of finding the first one's objects, and one job at a time makes
    # either build last several of the 5 s between a pipe's progress lines (in one CI run the
    # worker's 36-step build went first with parallel jobs and ended after 10 s and one line).
    salt = secrets.token_hex(4)
    header = f"/tmp/meshdeploy-progress-{salt}.h"
    for host in ("node1", "node2"):
        made = info.run(host, f"echo 'typedef int meshdeploy_progress_{salt}_{host};' > {header}")
        assert made.returncode == 0, made.stderr
    flags = "    cmake_flags: [-DGGML_NATIVE=OFF]"  # inventories/lab.yaml's own
    assert flags in text
    text = text.replace("    serial: true", "    serial: true\n    jobs: 1", 1).replace(
        flags, f"    cmake_flags: [-DGGML_NATIVE=OFF, '-DCMAKE_C_FLAGS=-include {header}']", 1)
    assert salt in text
    path = tmp_path_factory.mktemp("progress") / "lab.yaml"
    path.write_text(text)
    return path


def shape_mirror_to_node1(lab: str) -> None:
    """The Hugging Face mirror's answers (source port 8080) to node1 at 64 Mbit/s; everything
    else (git, apt, ssh) unshaped. On the bridge side of node1's veth: its egress is what node1
    downloads."""
    dev = "v-node1"

    def tc(*args):
        subprocess.run(["ip", "netns", "exec", lab, "tc", *args], check=True)

    subprocess.run(["ip", "netns", "exec", lab, "tc", "qdisc", "del", "dev", dev, "root"],
                   capture_output=True)
    tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20")
    tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "64mbit")
    tc("class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", "10gbit")
    tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "u32", "match", "ip",
       "sport", "8080", "0xffff", "flowid", "1:10")


def streamed_apply(*args) -> tuple[int, list[tuple[float, str]], str]:
    """meshdeploy apply with stdout a pipe, each line kept with the time it arrived."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "meshdeploy", "apply", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    lines = []
    for line in proc.stdout:
        lines.append((time.monotonic() - started, line.rstrip("\n")))
        print(f"{lines[-1][0]:7.1f} {lines[-1][1]}")
    err = proc.stderr.read()
    proc.wait(timeout=60)
    print(err, file=sys.stderr)
    return proc.returncode, lines, err


def percents_before_ok(lines, host: str, slot: str, pattern: str) -> list[int]:
    """The percentages of `host`'s progress lines for `slot` printed before its `ok` line."""
    texts = [t for _, t in lines]
    done = next(i for i, t in enumerate(texts)
                if re.match(rf"\s+{host}\s+{re.escape(slot)}\s+ok \(", t))
    found = []
    for t in texts[:done]:
        m = re.match(rf"\s+{host}\s+{re.escape(slot)}: {pattern}", t)
        if m:
            found.append(int(m.group("pct")))
    return found


def test_apply_in_a_pipe_reports_build_and_download_progress(pg_lab, cluster_file):
    info, _ = pg_lab
    shape_mirror_to_node1("mdpg")
    code, lines, err = streamed_apply(cluster_file, "--auto-approve")
    assert code == 0, err
    texts = [t for _, t in lines]
    assert not any(MARKER in t for t in texts) and MARKER not in err
    # The builds run one at a time (serial), each compiling ggml's C files for real. A host
    # whose build key another host builds copies that build instead (llama_cpp.copy).
    compiled = [h for h in ("node1", "node2")
                if any(re.match(rf"\s+{h}\s+llama_cpp\.build\s+ok \(", t) for t in texts)]
    assert compiled, texts
    builds = {host: percents_before_ok(lines, host, "llama_cpp.build",
                                       r"\[\d+/\d+\] (?P<pct>\d+)%")
              for host in compiled}
    for build in builds.values():
        assert build == sorted(build), build
    assert any(len(b) >= 2 and b[-1] > b[0] for b in builds.values()), (
        f"no build progress: {builds}")
    download = percents_before_ok(lines, "node1", "models.gguf[gemma]",
                                  r"gemma-3-270m-q4_k_m\.gguf [\d.]+ MB of 253\.1 MB "
                                  r"(?P<pct>\d+)%")
    assert len(download) >= 2 and download == sorted(download) and download[-1] > download[0]
    rates = [t for t in texts if "models.gguf[gemma]: " in t and " MB/s" in t]
    assert rates, "no download rate"
    # A pipe gets a line per host at most every 5 s: never two of one step within 4 s.
    seen: dict[str, float] = {}
    for at, t in lines:
        m = re.match(r"\s+(node\d)\s+(\S+): ", t)
        if m:
            key = f"{m.group(1)} {m.group(2)}"
            assert key not in seen or at - seen[key] > 4.0, (key, at, seen[key])
            seen[key] = at


def test_apply_json_carries_no_progress(pg_lab, cluster_file):
    info, _ = pg_lab
    gone = subprocess.run(hosts.ssh_argv(Path(info.ssh["config"]), "node1",
                                         f"sudo rm -f {MODEL} {MODEL}.meshdeploy-verified"),
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 0, gone.stderr
    code, lines, err = streamed_apply(cluster_file, "--auto-approve", "--json")
    assert code == 0, err
    out = "\n".join(t for _, t in lines)
    doc = json.loads(out)  # one document, nothing else on stdout
    steps = {(r["host"], r["step"]) for r in doc["applied"]}
    assert ("node1", "models.gguf[gemma]") in steps, doc["applied"]
    assert doc["plan"]["has_changes"] is True
    assert MARKER not in out + err
    assert not re.search(r"\d+%|MB/s|attempt \d+ of", out + err)
