"""The state file, every role's destroy hook, the destroy plan's text, and the locks.

Destroy hooks are run on facts as a real probe decodes them (tests/fixture/facts/*.Stored show the
shell side); the host-lock scripts run in a real shell against a temporary folder; the
control lock is a real flock held by a second process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import files as files_module
from meshdeploy.core import registry
from meshdeploy.core.plan import Plan
from meshdeploy.engine import locks
from meshdeploy.engine import planner as engine
from meshdeploy.engine import state as states
from meshdeploy.errors import PlanError
from meshdeploy.views.plan import render_json, render_text

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parents[1] / "golden" / "plan"
UPDATE = os.environ.get("MESHDEPLOY_UPDATE_GOLDEN") == "1"

UNIT = "# Managed by meshdeploy (cluster lab); `meshdeploy apply` rewrites this file.\n"
NODE3_FACTS = {
    "services.Units": {"meshdeploy-rpc-50052": {"active": "active", "enabled": "enabled",
                                                "content": UNIT}},
    "network.Allowlist": {"tcp/50052": ["10.200.0.11"]},
    "network.WireGuard": {"tools": ["wg"], "up": True, "enabled": True, "conf_sha256": "ab",
                          "public_key": "x" * 43 + "=", "addresses": ["10.99.0.3/16"]},
    "toolchain.AptProxy": 'Acquire::http::Proxy "http://10.200.0.1:3142";\n',
    "llama_cpp.Builds": {"current": "k1", "builds": {"k1": {}}},
    "llama_cpp.Stored": {"/opt/meshdeploy/builds": 41943040,
                         "/opt/meshdeploy/src/llama.cpp": 104857600},
    "models.Stored": {"/opt/meshdeploy/models/gemma": 253116416},
    "rpc_cache.Stored": {"/var/cache/private/meshdeploy-rpc-50052": 180355072,
                         "/var/cache/meshdeploy-rpc-50052": 0},
}


@pytest.fixture
def cluster(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text((ROOT / "inventories" / "lab.yaml").read_text())
    return load_cluster(path)


def _node3(cluster):
    return states.record_for(cluster, cluster.host("node3")).host(cluster.prefix)


def _teardown(cluster, facts, purge):
    host = _node3(cluster)
    return engine.teardown(cluster, [host], {host.name: facts}, run_values(), purge)


# --- destroy hooks ----------------------------------------------------------------------------


def test_every_role_declares_a_destroy_hook():
    assert {r.name for r in registry.roles() if r.destroy is None} == set()


def test_destroy_removes_units_rules_tunnel_and_keeps_the_bytes(cluster):
    torn, kept = _teardown(cluster, NODE3_FACTS, purge=False)
    changes = {f"{c.host}/{c.role}.{c.resource}": c for steps in torn.values() for s in steps
               for c in [s.change]}
    assert set(changes) == {"node3/services.rpc_server[50052]", "node3/network.allowlist",
                            "node3/network.wireguard", "node3/network.wireguard_key",
                            "node3/toolchain.apt_proxy"}
    assert all(c.action == "delete" for c in changes.values())
    commands = "\n".join(c for steps in torn.values() for s in steps for c in s.commands)
    assert "systemctl disable --now meshdeploy-rpc-50052" in commands
    assert "nft delete table inet meshdeploy" in commands
    assert "wg-quick@mdwg0" in commands and "/etc/meshdeploy/wireguard/mdwg0.key" in commands
    assert "rm -rf" not in commands  # no build, model or cache without --purge
    assert "apt-get" not in commands and "remove" not in commands.replace("rm -f", "")
    assert kept == ["node3: rpc-server caches meshdeploy-rpc-50052 (180.4 MB); "
                    "models gemma (253.1 MB); llama.cpp builds k1 (146.8 MB)"]
    # Services go first, the network after them, the toolchain's snippet last.
    order = [role for _, role in torn]
    assert order == ["services", "network", "toolchain"]


def test_purge_removes_builds_models_and_caches(cluster):
    torn, kept = _teardown(cluster, NODE3_FACTS, purge=True)
    assert kept == []
    purged = {role: " ".join(c for s in steps for c in s.commands)
              for (_, role), steps in torn.items()}
    assert "rm -rf -- /var/cache/meshdeploy-rpc-50052 /var/cache/private/meshdeploy-rpc-50052" \
        in purged["rpc_cache"]
    assert "rm -rf -- /opt/meshdeploy/models/gemma" in purged["models"]
    assert "rm -rf -- /opt/meshdeploy/builds /opt/meshdeploy/src/llama.cpp" in purged["llama_cpp"]
    assert "rmdir /opt/meshdeploy/src /opt/meshdeploy" in purged["llama_cpp"]
    order = [role for _, role in torn]
    assert order.index("rpc_cache") < order.index("models") < order.index("llama_cpp")


def test_a_host_with_nothing_of_meshdeploys_needs_nothing(cluster):
    torn, kept = _teardown(cluster, {}, purge=True)
    assert torn == {} and kept == []


def test_hostile_names_from_the_host_are_quoted(cluster):
    facts = {"models.Stored": {"/opt/meshdeploy/models/$(reboot); x": 4096}}
    torn, _ = _teardown(cluster, facts, purge=True)
    (step,) = torn[("node3", "models")]
    assert "'/opt/meshdeploy/models/$(reboot); x'" in step.commands[0]


def test_destroy_facts_are_gathered_only_for_leaving_hosts(cluster):
    host = cluster.host("node3")
    staying = {s.key for s in engine.probe_sections(cluster, host, False)}
    leaving = {s.key for s in engine.probe_sections(cluster, host, False, destroying=True)}
    assert leaving - staying == {"llama_cpp.Stored", "models.Stored", "rpc_cache.Stored"}


# --- the plan -----------------------------------------------------------------------------------


def _destroy_plan(cluster, purge=False) -> Plan:
    torn, kept = _teardown(cluster, NODE3_FACTS, purge)
    return Plan(cluster_name="lab", cluster_path="inventories/lab.yaml", config_hash="0" * 64,
                fingerprints={}, changes=[s.change for steps in torn.values() for s in steps],
                hosts=["node3"], created_at="2025-01-01T00:00:00Z", meshdeploy_version="0.1.0",
                kept=kept, purge=purge)


def test_golden_destroy_plan_text(cluster):
    text = render_text(_destroy_plan(cluster))
    path = GOLDEN / "destroy.txt"
    if UPDATE:
        path.write_text(text + "\n")
    assert text + "\n" == path.read_text()
    assert text.endswith("Plan: 0 to add, 0 to change, 5 to destroy.")


def test_destroy_plan_json_carries_what_is_kept(cluster):
    doc = json.loads(render_json(_destroy_plan(cluster)))
    assert doc["kept"] and doc["purge"] is False
    assert doc["counts"] == {"add": 0, "change": 0, "destroy": 5}
    saved = Plan.from_dict(_destroy_plan(cluster, purge=True).to_dict())
    assert saved.purge is True and saved.kept == []


# --- the state file -------------------------------------------------------------------------------


def test_state_round_trip_and_departed_hosts(cluster):
    state = states.load(cluster)
    assert not state.exists and state.hosts == {}
    states.after_apply(state, cluster, cluster.hosts, {}, ok=True)
    path = states.state_path(cluster.path)
    assert path.name == "lab.state.json" and path.parent == cluster.path.parent
    data = json.loads(path.read_text())
    assert data["format_version"] == states.FORMAT_VERSION and data["serial"] == 1
    assert data["hosts"]["node3"]["units"] == ["meshdeploy-rpc-50052"]
    assert data["hosts"]["node1"]["units"] == ["meshdeploy-server-main"]
    smaller = load_cluster(_without_node3(cluster))
    again = states.load(smaller)
    (gone,) = again.departed(smaller)
    assert gone.name == "node3" and gone.address == "10.200.0.13"
    assert gone.ssh == cluster.host("node3").ssh and gone.rpc_servers == ()
    # Destroyed without --purge: retired, visited again only by --purge runs.
    states.after_apply(again, smaller, smaller.hosts, {"node3": False}, ok=True)
    again = states.load(smaller)
    assert again.departed(smaller) == [] and [h.name for h in again.departed(smaller, True)] \
        == ["node3"]
    states.after_apply(again, smaller, smaller.hosts, {"node3": True}, ok=True)
    assert "node3" not in states.load(smaller).hosts


def test_a_failed_apply_keeps_the_departed_host(cluster):
    state = states.load(cluster)
    states.after_apply(state, cluster, cluster.hosts, {}, ok=True)
    smaller = load_cluster(_without_node3(cluster))
    state = states.load(smaller)
    states.after_apply(state, smaller, smaller.hosts, {"node3": True}, ok=False)
    assert states.load(smaller).hosts["node3"].status == states.MANAGED


def _without_node3(cluster) -> Path:
    text = cluster.path.read_text()
    node3 = text[text.index("  node3:\n"):text.index("models:\n")]
    cluster.path.write_text(text.replace(node3, ""))
    return cluster.path


def test_state_write_is_atomic(cluster, monkeypatch):
    state = states.load(cluster)
    states.after_apply(state, cluster, cluster.hosts, {}, ok=True)
    path = states.state_path(cluster.path)
    before = path.read_bytes()

    def broken(*args):
        raise OSError("disk full")

    monkeypatch.setattr(files_module.os, "replace", broken)
    with pytest.raises(OSError):
        states.save(state)
    assert path.read_bytes() == before  # the old state, whole
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("content, message", [
    (b"{not json", "not a meshdeploy state file (not JSON)"),
    (b"\xff\xfe", "not a meshdeploy state file (not JSON)"),
    (b"[]", "not a meshdeploy state file (no format_version)"),
    (b'{"format_version": 99, "cluster": "lab"}', "state format 99 is not supported"),
    (b'{"format_version": 1, "cluster": "lab", "hosts": {"n": {"address": "a"}}}',
     "damaged state file"),
    (b'{"format_version": 1, "cluster": "lab", "hosts": {"n": {"address": "a", "ssh": {}, '
     b'"x": 1}}}', "damaged state file"),
    (b'{"format_version": 1, "cluster": "other", "hosts": {}}', "the state is of cluster"),
])
def test_a_bad_state_file_is_one_clear_error(cluster, content, message):
    states.state_path(cluster.path).write_bytes(content)
    with pytest.raises(PlanError) as err:
        states.load(cluster)
    assert message in str(err.value) and "lab.state.json" in str(err.value)
    assert err.value.hint


# --- locks ------------------------------------------------------------------------------------


HOLD = """
import fcntl, json, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, json.dumps({"pid": os.getpid(), "machine": "box", "user": "ann",
                         "since": "2026-01-01T00:00:00Z", "command": "apply"}).encode())
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_control_lock_is_refused_naming_the_holder(cluster):
    path = locks.lock_path(cluster.path)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(locks.LockedError) as err:
            locks.ControlLock(cluster.path, locks.me("apply"), timeout=0.5).acquire()
        assert f"meshdeploy apply of ann@box (pid {holder.pid}), since 2026-01-01" \
            in str(err.value)
        assert "-lock-timeout" in err.value.hint
    finally:
        holder.kill()
        holder.wait()
    # The kernel dropped the dead holder's lock: never stale on the control machine.
    with locks.ControlLock(cluster.path, locks.me("apply")):
        pass


def _sh(script: str) -> list[str]:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def test_host_lock_script_acquires_refuses_and_releases(tmp_path):
    lock = str(tmp_path / "run" / "apply.lock")
    first, second = locks.me("apply"), locks.me("destroy")
    assert locks.parse_answer(_sh(locks.acquire_script(first, lock=lock))).acquired
    answer = locks.parse_answer(_sh(locks.acquire_script(second, lock=lock)))
    assert not answer.acquired and answer.holder == first and answer.age <= 2
    assert not answer.stale()  # a live process of this machine, fresh heartbeat
    _sh(locks.release_script(second, lock=lock))  # not its lock: kept
    assert Path(lock).is_dir()
    _sh(locks.release_script(first, lock=lock))
    assert not Path(lock).exists()


def test_stale_host_locks(tmp_path):
    lock = str(tmp_path / "apply.lock")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    gone = locks.Holder(int(dead), locks.me("x").machine, "ann", "2026-01-01T00:00:00Z", "apply",
                        "t1")
    _sh(locks.acquire_script(gone, lock=lock))
    answer = locks.parse_answer(_sh(locks.acquire_script(locks.me("apply"), lock=lock)))
    assert not answer.acquired and answer.stale()  # its pid is dead on this machine
    took = locks.parse_answer(_sh(locks.acquire_script(locks.me("apply"), answer.owner,
                                                       lock=lock)))
    assert took.acquired
    # Another machine's holder: stale only once its heartbeat is older than STALE.
    remote = locks.Holder(1, "elsewhere", "bob", "2026-01-01T00:00:00Z", "apply", "t2")
    line = json.dumps(remote.__dict__)
    assert not locks.Answer(False, locks.STALE - 1, line).stale()
    assert locks.Answer(False, locks.STALE + 1, line).stale()


@pytest.mark.parametrize("text, seconds", [("0", 0), ("30s", 30), ("5m", 300), ("1.5h", 5400),
                                           ("12", 12)])
def test_lock_timeout_durations(text, seconds):
    assert locks.duration(text) == seconds


def test_a_bad_lock_timeout_is_one_clear_error():
    with pytest.raises(PlanError, match="not a duration"):
        locks.duration("soon")
