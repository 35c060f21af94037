"""Zero weight transfer on the lab: pre-seeded rpc-server caches versus the stock load.

A synthetic llama GGUF (~360 MB, three 23 MB FFN tensors per layer) is served by the lab's HF
mirror and loaded through node2 and node3. The bytes the bridge sends to each worker while
llama-server restarts are counted on the worker's veth: stock, every weight crosses; seeded,
only the tensors of 10 MiB or less (and protocol chatter) do. Greedy output must not change.
Runs after test_cluster.py and puts the gemma cluster back when done.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from meshdeploy.lab import base, hfstore
from support import wire
from support.synthetic import SMALL, write_llama
from support.cli import meshdeploy
from support.labfile import write_lab_file
from meshdeploy.placement.layers import device_tensors, place, wire_bytes
from meshdeploy.placement.tensors import weight_tensors

pytestmark = [pytest.mark.lab, pytest.mark.build]

SLACK = 4 * 1024 * 1024  # RPC commands, graph uploads, TCP/IP headers: far below one tensor


def _restore(lab, tmp_path):
    gemma = write_lab_file(lab, tmp_path / "restore")
    assert meshdeploy("apply", gemma, "--auto-approve").returncode == 0
    for host in ("node2", "node3"):
        lab.run(host, "sudo rm -rf /opt/meshdeploy/models/synthetic "
                      "/var/cache/meshdeploy-rpc-50052/rpc")


def test_seeded_load_sends_no_cached_weight(lab, tmp_path):
    model = write_llama(tmp_path / "synthetic.gguf", SMALL)
    served = hfstore.add_file(base.cache_root() / "hf", "meshdeploy/synthetic-llama",
                               "synthetic.gguf", model)
    tensors = weight_tensors(model)
    placement = place(SMALL.n_layers, ["node2", "node3"], [1, 1])
    per_worker = {h: device_tensors(placement, tensors, i) for i, h in enumerate(["node2", "node3"])}
    results = {}
    hf_log = Path(lab.state_dir) / "run" / "hf.log"
    mark = hf_log.stat().st_size if hf_log.exists() else 0
    share_mark = len(_share_log(lab))
    try:
        for cache in (False, True):
            folder = tmp_path / ("seeded" if cache else "stock")
            folder.mkdir()
            cluster = folder / "synthetic.yaml"
            cluster.write_text(wire.cluster_yaml(lab, served["repo"], served["file"],
                                                 served["sha256"], cache))
            extra = _failover_seed(cluster) if cache else {}
            received = {h: wire.tx_bytes(lab.name, h) for h in per_worker}
            applied = meshdeploy("apply", cluster, "--auto-approve")
            assert applied.returncode == 0, applied.stderr
            received = {h: wire.tx_bytes(lab.name, h) - received[h] for h in per_worker}
            if cache:
                assert "Placement of synthetic for llama-server main" in applied.stdout
                _check_distribution(lab, per_worker, received, model.stat().st_size,
                                    share_mark, served["sha256"], extra)
            before = {h: wire.tx_bytes(lab.name, h) for h in per_worker}
            seconds = wire.restart_server(lab)
            sent = {h: wire.tx_bytes(lab.name, h) - before[h] for h in per_worker}
            results[cache] = {"sent": sent, "seconds": seconds, "text": wire.complete(lab)}
            print(f"cache={cache}: {seconds:.2f} s to /health 200, sent {sent}")
            again = meshdeploy("plan", cluster, "--detailed-exitcode")
            assert again.returncode == 0, again.stdout
    finally:
        _restore(lab, tmp_path)
    # One download from the internet for the whole test: node1's.
    fetched = _full_downloads(hf_log, mark, served)
    assert len(fetched) == 1, fetched
    for host, mine in per_worker.items():
        hashed, small = wire_bytes(mine)
        assert hashed > 2 * 10 * 1024 * 1024, f"{host} gets too few large tensors to tell"
        assert results[False]["sent"][host] >= hashed + small  # stock: every weight crosses
        # Seeded: not one byte of a cached tensor (each > 10 MiB) crossed, only the small ones.
        assert results[True]["sent"][host] <= small + SLACK, (host, results[True]["sent"], small)
    assert results[True]["text"] == results[False]["text"]
    assert results[True]["text"].strip()


def test_whole_copies_come_from_the_orchestrator_not_the_internet(lab, tmp_path):
    """Workers with `fetch: false` keep a whole GGUF: they copy node1's over the LAN while node1
    downloads it (md-share serves the growing partial), so the mirror still serves it once."""
    model = write_llama(tmp_path / "copied.gguf", SMALL, seed=4321)
    served = hfstore.add_file(base.cache_root() / "hf", "meshdeploy/synthetic-copied",
                               "copied.gguf", model)
    size = model.stat().st_size
    text = wire.cluster_yaml(lab, served["repo"], served["file"], served["sha256"], True)
    assert text.count("cache: true}") == 2
    cluster = tmp_path / "copied.yaml"
    cluster.write_text(text.replace("cache: true}", "cache: true, fetch: false}"))
    hf_log = Path(lab.state_dir) / "run" / "hf.log"
    mark = hf_log.stat().st_size if hf_log.exists() else 0
    share_mark = len(_share_log(lab))
    try:
        plan = meshdeploy("plan", cluster)
        assert "to copy from node1 over the LAN" in plan.stdout, plan.stdout[-3000:]
        applied = meshdeploy("apply", cluster, "--auto-approve")
        assert applied.returncode == 0, applied.stderr
        for host in ("node1", "node2", "node3"):
            got = lab.run(host, "sudo sha256sum /opt/meshdeploy/models/synthetic/copied.gguf")
            assert got.stdout.split()[:1] == [served["sha256"]], (host, got.stdout, got.stderr)
        copied = {}
        for line in _share_log(lab)[share_mark:]:
            words = line.split()
            if len(words) == 7 and words[2] == "GET" and words[3] == f"/models/{served['sha256']}":
                # 404: asked of the md-share an earlier step left running (it serves other
                # content) before node1's step replaced it; the copy asks again.
                assert words[4] in ("200", "206", "404"), line
                if words[4] != "404":
                    copied[words[1]] = copied.get(words[1], 0) + int(words[6])
        print(f"md-share copied {copied} of a {size}-byte model")
        assert copied.get("10.200.0.12", 0) >= size and copied.get("10.200.0.13", 0) >= size
        again = meshdeploy("plan", cluster, "--detailed-exitcode")
        assert again.returncode == 0, again.stdout
    finally:
        _restore(lab, tmp_path)
    fetched = _full_downloads(hf_log, mark, served)
    assert len(fetched) == 1, fetched  # node1's: the copies came from node1


def _full_downloads(hf_log: Path, mark: int, served: dict) -> list[str]:
    """The mirror's full-body GETs of the served file since `mark`: they answer 200 (the
    control machine's header reads and any resume are ranged, 206)."""
    return [line for line in hf_log.read_text()[mark:].splitlines()
            if f"GET /{served['repo']}/resolve/" in line and f"/{served['file']} " in line
            and '" 200 ' in line]


def _share_log(lab) -> list[str]:
    return lab.run("node1", "sudo cat /var/log/meshdeploy-share.log 2>/dev/null; "
                            "true").stdout.splitlines()


def _failover_seed(cluster) -> dict:
    """host -> the hashed bytes failover.seed (on by default, tolerate 1) adds to its cache: the
    tensors it holds only while the other worker is away, which the plan counts apart."""
    import json

    plan = meshdeploy("plan", cluster, "--json")
    assert plan.returncode in (0, 2), plan.stderr
    (server,) = json.loads(plan.stdout)["placement"]
    assert server["tolerate"] == 1, server
    extra = {key.partition(":")[0]: n for key, n in server["failover_seed_bytes"].items()}
    # Either worker alone takes layers the full placement gives the other: each caches more.
    assert set(extra) == {"node2", "node3"} and all(n > 0 for n in extra.values()), extra
    return extra


def _check_distribution(lab, per_worker: dict, received: dict, model_size: int,
                        mark: int, sha256: str, extra: dict) -> None:
    """Cached workers keep no GGUF, only their cache entries, fetched from node1's copy by
    md-share: each received about its share of the weights (its full placement's tensors, which
    this test computes, and what failover adds), not the model."""
    served = {}  # this test's tensor fetches: ranged (206) GETs of /models/synthetic
    for line in _share_log(lab)[mark:]:
        words = line.split()
        # A build's tarball (llama_cpp.copy: /models/<key>.tar.gz, on hosts that had none yet)
        # is not a model's: only the model's file, by its sha256, counts here.
        if len(words) == 7 and words[2] == "GET" and words[3] == f"/models/{sha256}":
            assert words[4] == "206", line  # ranged answers only, and never a refusal
            served[words[1]] = served.get(words[1], 0) + int(words[6])
    print(f"md-share served {served}; workers received {received} during the apply")
    for i, (host, mine) in enumerate(per_worker.items()):
        hashed, small = wire_bytes(mine)
        hashed += extra[host]
        ggufs = lab.run(host, "sudo find /opt/meshdeploy/models -name '*.gguf*' 2>/dev/null; "
                              "true").stdout.split()
        assert ggufs == [], (host, ggufs)
        entries = lab.run(host, "sudo sh -c 'cat /var/cache/meshdeploy-rpc-50052/rpc/"
                                "[0-9a-f]* | wc -c'").stdout.strip()
        assert int(entries) == hashed, (host, entries, hashed)
        assert served.get(f"10.200.0.{12 + i}") == hashed, (host, served)
        # Its share, then llama-server's load (the small tensors): less than a copy of the
        # model and one load, which is what downloading the GGUF alone would have cost.
        assert received[host] < model_size + small, (host, received[host], model_size, small)


def test_seeding_from_a_file_already_on_the_hosts(lab, tmp_path):
    """A `path:` model (the same file on every host, as when copied by hand): the plan reads its
    header over SFTP from the worker, seeds from the worker's copy, and the load sends only the
    small tensors."""
    model = write_llama(tmp_path / "synthetic.gguf", SMALL)
    served = hfstore.add_file(base.cache_root() / "hf", "meshdeploy/synthetic-llama",
                               "synthetic.gguf", model)
    where = "/srv/models/synthetic.gguf"
    url = f"http://10.200.0.1:8080/{served['repo']}/resolve/main/{served['file']}"
    for host in ("node1", "node2", "node3"):
        got = lab.run(host, f"sudo mkdir -p /srv/models && sudo curl -sf -o {where} {url} && "
                            f"sha256sum {where}")
        assert got.stdout.split()[0] == served["sha256"], got.stderr
    text = wire.cluster_yaml(lab, served["repo"], served["file"], served["sha256"], True)
    head, _, tail = text.partition("\nmodels:\n")
    _, _, servers = tail.partition("\nservers:\n")
    cluster = tmp_path / "path.yaml"
    cluster.write_text(f"{head}\nmodels:\n  synthetic:\n    path: {where}\nservers:\n{servers}")
    cache = tmp_path / "xdg"
    env_cache = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    try:
        applied = meshdeploy("apply", cluster, "--auto-approve", env=env_cache)
        assert applied.returncode == 0, applied.stderr
        assert "Placement of synthetic for llama-server main" in applied.stdout
        # Read once over SFTP from node2 (the first worker that seeds), then kept by content.
        assert len(list((cache / "meshdeploy" / "gguf-headers").glob("*.gguf"))) == 1
        marker = lab.run("node2", "sudo cat /var/cache/meshdeploy-rpc-50052/rpc/.meshdeploy-seeded")
        size_mtime = lab.run("node2", f"stat -c 'path-%s-%Y' {where}").stdout.strip()
        assert marker.stdout.split()[0] == size_mtime
        tensors = weight_tensors(model)
        mine = device_tensors(place(SMALL.n_layers, ["node2", "node3"], [1, 1]), tensors, 0)
        hashed, small = wire_bytes(mine)
        before = wire.tx_bytes(lab.name, "node2")
        wire.restart_server(lab)
        sent = wire.tx_bytes(lab.name, "node2") - before
        print(f"path model, seeded node2: {sent} bytes sent at start; its tensors: {hashed} "
              f"cached + {small} small")
        assert sent <= small + SLACK, (sent, small, hashed)
        assert wire.complete(lab).strip()
        again = meshdeploy("plan", cluster, "--detailed-exitcode", env=env_cache)
        assert again.returncode == 0, again.stdout
    finally:
        _restore(lab, tmp_path)
        for host in ("node1", "node2", "node3"):
            lab.run(host, "sudo rm -rf /srv/models")


CACHE = "/var/cache/meshdeploy-rpc-50052"
# Root's files a worker's rpc-server must never reach through the seeding step: the planted
# links' targets, a folder of entry-like names, and files any host has.
_VICTIMS = "/etc/md-victim-* /root/md-victims/* /etc/passwd /etc/shadow /etc/sudoers"


def _as_rpc_server(lab, host: str, script: str):
    """`script` as node's rpc-server itself: its user, in its own sandbox (mount namespace)."""
    pid = lab.run(host, "systemctl show -P MainPID meshdeploy-rpc-50052").stdout.strip()
    assert pid.isdigit() and pid != "0", pid
    uid = lab.run(host, f"stat -c %u /proc/{pid}").stdout.strip()
    got = lab.run(host, f"sudo nsenter -t {pid} -m -S {uid} -G {uid} sh -c {shlex.quote(script)}")
    assert got.returncode == 0, got.stderr
    return got


def _root_files(lab, host: str) -> str:
    return lab.run(host, f"sudo sh -c 'sha256sum {_VICTIMS}; ls /etc /root'").stdout


def _check_entries(lab, host: str) -> int:
    """Every entry is a regular file whose bytes hash to its name, and the marker names them
    all; gives how many there are."""
    got = lab.run(host, f"sudo sh -c 'cd {CACHE}/rpc && test ! -L . && "
                        "for f in [0-9a-f]*; do test -f \"$f\" && test ! -L \"$f\" || exit 1; "
                        "h=$(/opt/meshdeploy/tools/md-rpc-seed --hash \"$f\" 0 $(stat -c %s \"$f\")); "
                        "test \"$h\" = \"$f\" || exit 1; grep -q \" $f\\$\" .meshdeploy-seeded || "
                        "exit 1; echo \"$f\"; done'")
    assert got.returncode == 0, (host, got.stdout, got.stderr)
    return len(got.stdout.split())


def test_links_planted_by_the_rpc_server_are_never_followed(lab, tmp_path):
    """A taken-over rpc-server prepares its cache folder for the next apply: a link at every
    name the seeding step writes, to root's files (and dangling ones, to make new files), then
    the folder itself as a link to a root folder. Each apply re-seeds: root's files are as they
    were and the cache is right."""
    model = write_llama(tmp_path / "planted.gguf", SMALL, seed=99)
    served = hfstore.add_file(base.cache_root() / "hf", "meshdeploy/synthetic-planted",
                               "planted.gguf", model)
    cluster = tmp_path / "planted.yaml"
    cluster.write_text(wire.cluster_yaml(lab, served["repo"], served["file"], served["sha256"],
                                         True))
    lab.run("node2", "sudo sh -c 'mkdir -p /root/md-victims; for i in 0 1 2 3 4 5 6 7 8 9; do "
                     "echo victim $i > /etc/md-victim-$i; done; "
                     "echo keep > /root/md-victims/0123456789abcdef; "
                     "echo keep > /root/md-victims/.meshdeploy-seeded'")
    try:
        applied = meshdeploy("apply", cluster, "--auto-approve")
        assert applied.returncode == 0, applied.stderr
        entries = _check_entries(lab, "node2")
        assert entries > 0
        before = _root_files(lab, "node2")
        # Round 1: links at every name, old releases' work names included; entries removed.
        _as_rpc_server(lab, "node2", f"""set -e
cd {CACHE}/rpc
i=0
for f in [0-9a-f]*; do
  rm -f "$f"; ln -s /etc/md-victim-$((i % 10)) "$f"; ln -s /etc/md-victim-$((i % 10)) ".$f.tmp"
  ln -s /etc/md-created-$i ".$f.tmp.dangling"; i=$((i + 1))
done
for n in .meshdeploy-seeded .meshdeploy-seeded.tmp .meshdeploy-seed-list \
         .meshdeploy-seed-list.out .meshdeploy-seed-list.0 .meshdeploy-seed-list.0.m; do
  rm -f "$n"; ln -s /etc/md-victim-$((i % 10)) "$n"; i=$((i + 1))
done
ls -la""")
        plan = meshdeploy("plan", cluster)
        assert "rpc_cache.seed[50052]" in plan.stdout, plan.stdout[-3000:]
        applied = meshdeploy("apply", cluster, "--auto-approve")
        assert applied.returncode == 0, applied.stderr
        assert _root_files(lab, "node2") == before
        assert lab.run("node2", "ls /etc/md-created-* 2>/dev/null").stdout == ""
        assert _check_entries(lab, "node2") == entries
        # Round 2: the folder itself becomes a link to a root folder of entry-like names.
        _as_rpc_server(lab, "node2", f"cd {CACHE} && rm -rf rpc && ln -s /root/md-victims rpc")
        applied = meshdeploy("apply", cluster, "--auto-approve")
        assert applied.returncode == 0, applied.stderr
        assert _root_files(lab, "node2") == before
        assert _check_entries(lab, "node2") == entries
        again = meshdeploy("plan", cluster, "--detailed-exitcode")
        assert again.returncode == 0, again.stdout
        assert wire.complete(lab).strip()
    finally:
        lab.run("node2", "sudo rm -rf /etc/md-victim-* /etc/md-created-* /root/md-victims")
        _restore(lab, tmp_path)
