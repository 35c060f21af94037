"""Cluster file loading: every kind of error points at file:line:col with a useful message."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.sources import HfSource, OllamaSource, PathSource
from meshdeploy.errors import CONFIG, ConfigError
from meshdeploy.roles.models import hf

ROOT = Path(__file__).resolve().parents[2]

# Three lines, so the body of every snippet below starts at line 4.
HEAD = "cluster: t\nllama_cpp:\n  ref: b1\n"

HOSTS = """\
hosts:
  node1:
    address: 10.0.0.1
  node2:
    address: 10.0.0.2
    rpc_servers:
      - port: 50052
"""
MODELS = "models:\n  m: {path: /m.gguf}\n"


def write(tmp_path: Path, body: str, head: str = HEAD) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(head + body)
    return path


def issues(tmp_path: Path, body: str, head: str = HEAD) -> list[str]:
    path = write(tmp_path, body, head)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert info.value.exit_code == CONFIG
    prefix = f"{path}:"
    return [str(i)[len(prefix):] if str(i).startswith(prefix) else str(i)
            for i in info.value.issues]


def first(tmp_path: Path, body: str, head: str = HEAD):
    path = write(tmp_path, body, head)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    issue = info.value.issues[0]
    assert issue.file == str(path)
    return issue


# -- YAML and schema errors ------------------------------------------------------------------

def test_malformed_yaml_points_at_the_problem(tmp_path):
    issue = first(tmp_path, "hosts: [a, b\nmodels: {}\n")
    assert (issue.line, issue.col) == (5, 7)
    assert issue.message.startswith("YAML syntax error: expected ',' or ']'")
    assert "started at line 4" in issue.message


def test_duplicate_key_names_both_lines(tmp_path):
    issue = first(tmp_path, HOSTS + "  node1:\n    address: 10.0.0.9\n")
    assert (issue.line, issue.col, issue.path) == (11, 3, "hosts.node1")
    assert issue.message == "duplicate key 'node1' (first defined at line 5)"


def test_empty_file(tmp_path):
    issue = first(tmp_path, "", head="# nothing\n")
    assert (issue.line, issue.message) == (1, "the cluster file is empty; expected a mapping")


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster(tmp_path / "missing.yaml")


def test_wrong_type_suggests_quoting(tmp_path):
    issue = first(tmp_path, HOSTS, head="cluster: t\nllama_cpp:\n  ref: 1234\n")
    assert (issue.line, issue.col, issue.path) == (3, 8, "llama_cpp.ref")
    assert issue.message == "expected a string, got integer 1234"
    assert issue.hint == "quote it: '1234'"


def test_unknown_key_points_at_the_key_with_suggestion(tmp_path):
    issue = first(tmp_path, HOSTS.replace("    address: 10.0.0.1", "    adress: 10.0.0.1"))
    assert (issue.line, issue.col, issue.path) == (6, 5, "hosts.node1.adress")
    assert issue.message == "unknown key 'adress'"
    assert issue.hint == "did you mean 'address'?"


def test_enum_typo(tmp_path):
    issue = first(tmp_path, HOSTS.replace("10.0.0.1\n", "10.0.0.1\n    backend: cudaa\n"))
    assert (issue.line, issue.col, issue.path) == (7, 14, "hosts.node1.backend")
    assert issue.message == "'cudaa' is not one of cpu, cuda, metal, vulkan, rocm"
    assert issue.hint == "did you mean 'cuda'?"


def test_missing_required_key(tmp_path):
    issue = first(tmp_path, "hosts:\n  node1:\n    backend: cpu\n")
    assert (issue.line, issue.col, issue.path) == (5, 3, "hosts.node1")
    assert issue.message == "missing required key 'address'"


def test_missing_top_level_key(tmp_path):
    issue = first(tmp_path, "", head="cluster: t\nhosts: {a: {address: 10.0.0.1}}\n")
    assert (issue.line, issue.col, issue.path) == (1, 1, "")
    assert issue.message == "missing required key 'llama_cpp'"


def test_either_or_field_with_neither(tmp_path):
    body = HOSTS + MODELS + "servers:\n  s:\n    host: node1\n    model: m\n" \
                            "    tensor_split: Auto\n"
    issue = first(tmp_path, body)
    assert (issue.line, issue.col, issue.path) == (17, 19, "servers.s.tensor_split")
    assert issue.message == "'Auto' is not 'auto' or a list of numbers, one per device"


def test_negative_split_value_points_at_the_value(tmp_path):
    body = HOSTS + MODELS + "servers:\n  s:\n    host: node1\n    model: m\n" \
                            "    tensor_split: [1, -1]\n"
    issue = first(tmp_path, body)
    assert (issue.line, issue.path) == (17, "servers.s.tensor_split[1]")
    assert issue.message == "-1 is out of range: must be at least 0"


def test_at_most_15_split_values(tmp_path):
    body = HOSTS + MODELS + "servers:\n  s:\n    host: node1\n    model: m\n" \
                            f"    tensor_split: [{', '.join(['1'] * 16)}]\n"
    issue = first(tmp_path, body)
    assert (issue.line, issue.path) == (17, "servers.s.tensor_split")
    assert issue.message == "has 16 values; llama.cpp accepts at most 15"


def test_host_name_with_colon(tmp_path):
    issue = first(tmp_path, "hosts:\n  'a:b':\n    address: 10.0.0.1\n")
    assert (issue.line, issue.col, issue.path) == (5, 3, "hosts.a:b")
    assert issue.message == "'a:b' is not a valid name"


def test_model_needs_exactly_one_source(tmp_path):
    issue = first(tmp_path, HOSTS + "models:\n  m: {path: /m.gguf, ollama: {model: x}}\n")
    assert (issue.line, issue.path) == (12, "models.m")
    assert issue.message == "has several sources (path, ollama); keep exactly one"


def test_pattern_message_is_human(tmp_path):
    issue = first(tmp_path, HOSTS + "models:\n  m: {huggingface: {repo: nope, file: x.gguf}}\n")
    assert issue.path == "models.m.huggingface.repo"
    assert issue.message == "'nope' is not a Hugging Face repository id (owner/name)"


def test_best_issue_first_then_count(tmp_path):
    body = HOSTS.replace("    address: 10.0.0.1", "    adress: 10.0.0.1\n    backend: cudaa")
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    text = str(info.value)
    assert text.splitlines()[0].startswith(f"{path}:")
    assert text.endswith("\n2 more errors (--verbose)")
    assert len(info.value.issues) == 3
    assert "hint:" in info.value.render(verbose=True)


# -- semantic checks -------------------------------------------------------------------------

def test_duplicate_rpc_port_on_a_host(tmp_path):
    body = HOSTS.replace("    rpc_servers:", "    backend: metal\n    rpc_servers:") + \
        "        device: MTL0\n      - port: 50052\n        device: CPU\n"
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("13:15: hosts.node2.rpc_servers[1].port: port 50052 on host node2 "
                            "is already used by hosts.node2.rpc_servers[0]")


def test_server_port_collides_with_rpc_server(tmp_path):
    body = HOSTS + MODELS + "servers:\n  s: {host: node2, model: m, port: 50052}\n"
    (issue,) = issues(tmp_path, body)
    assert issue == ("14:36: servers.s.port: port 50052 on host node2 is already used by "
                     "hosts.node2.rpc_servers[0]")


def test_vulkan_visible_devices_only_on_a_vulkan_host(tmp_path):
    body = HOSTS.replace("    rpc_servers:", "    vulkan_visible_devices: [0]\n    rpc_servers:")
    (issue,) = issues(tmp_path, body)
    assert issue == ("9:5: hosts.node2.vulkan_visible_devices: is read only on a vulkan host; "
                     "host node2 is cpu")


def test_vulkan_visible_devices_name_the_hosts_devices(tmp_path):
    body = HOSTS.replace("    rpc_servers:",
                         "    backend: vulkan\n    vulkan_visible_devices: [2, 0]\n"
                         "    rpc_servers:")
    host = load_cluster(write(tmp_path, body)).host("node2")
    assert host.devices == ("Vulkan0", "Vulkan1") and host.vulkan_visible == (2, 0)
    (issue,) = issues(tmp_path, body.replace("[2, 0]", "[2, 2]"))
    assert issue.startswith("10:5: hosts.node2.vulkan_visible_devices: ")
    more = body.replace("[2, 0]", "[2]").replace("    rpc_servers:",
                                                 "    devices: [Vulkan0, Vulkan1]\n    rpc_servers:")
    (issue,) = issues(tmp_path, more)
    assert issue.startswith("11:5: hosts.node2.devices: names Vulkan1, but vulkan_visible_devices "
                            "makes only 1 Vulkan device(s) visible")


def test_two_rpc_servers_with_all_devices_conflict(tmp_path):
    (issue,) = issues(tmp_path, HOSTS + "      - port: 50053\n")
    assert issue.startswith("11:9: hosts.node2.rpc_servers[1].device: shares device CPU with "
                            "hosts.node2.rpc_servers[0]")


def test_two_rpc_servers_on_one_device_conflict(tmp_path):
    body = HOSTS.replace("    rpc_servers:", "    backend: metal\n    rpc_servers:") + \
        "        device: MTL0\n      - port: 50053\n        device: MTL0\n"
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("14:17: hosts.node2.rpc_servers[1].device: shares device MTL0")


def test_device_must_belong_to_the_host(tmp_path):
    body = HOSTS.replace("    rpc_servers:", "    backend: cuda\n    rpc_servers:") + \
        "        device: CUDA1\n"
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("12:17: hosts.node2.rpc_servers[0].device: 'CUDA1' is not a device "
                            "of host node2 (cuda: CUDA0, CPU)")


def test_tensor_split_length_counts_devices(tmp_path):
    body = HOSTS + MODELS + "servers:\n  s:\n    host: node1\n    model: m\n" \
                            "    tensor_split: [0.5, 0.5]\n"
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("17:5: servers.s.tensor_split: has 2 values for 1 devices")


def test_tensor_split_not_all_zero(tmp_path):
    body = HOSTS + MODELS + "servers:\n  s:\n    host: node1\n    model: m\n" \
                            "    tensor_split: [0]\n"
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("17:5: servers.s.tensor_split: all values are 0")


def test_server_references_resolve(tmp_path):
    body = HOSTS + MODELS + "servers:\n  s:\n    host: nod1\n    model: n\n"
    found = issues(tmp_path, body)
    assert found[0].startswith("15:11: servers.s.host: unknown host 'nod1'")
    assert found[1].startswith("16:12: servers.s.model: unknown model 'n'")


def test_rpc_entries_resolve(tmp_path):
    body = HOSTS + MODELS + \
        "servers:\n  s:\n    host: node1\n    model: m\n    rpc: [node3:50052, node2:1]\n"
    found = issues(tmp_path, body)
    assert found == [
        "17:11: servers.s.rpc[0]: unknown host 'node3' in 'node3:50052'",
        "17:24: servers.s.rpc[1]: host node2 has no rpc-server on port 1",
    ]


def test_one_orchestrator_per_model(tmp_path):
    body = HOSTS + MODELS + "servers:\n  a: {host: node1, model: m}\n" \
                            "  b: {host: node1, model: m, port: 8081, rpc: none}\n"
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("15:27: servers.b.model: model 'm' is already served by servers.a")


def test_rpc_server_has_one_client(tmp_path):
    body = HOSTS + "models:\n  m: {path: /m.gguf}\n  n: {path: /n.gguf}\n" + \
        "servers:\n  a: {host: node1, model: m}\n  b: {host: node1, model: n, port: 8081}\n"
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("16:3: servers.b.rpc: rpc-server node2:50052 is already used by "
                            "servers.a")


def test_public_bind_needs_opt_in(tmp_path):
    body = HOSTS.replace("10.0.0.2", "203.0.113.5")
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("10:9: hosts.node2.rpc_servers[0]: binds 203.0.113.5, which is not "
                            "a private or loopback address")
    load_cluster(write(tmp_path, body + "network: {allow_public: true}\n"))


def test_wildcard_bind_needs_opt_in(tmp_path):
    (issue,) = issues(tmp_path, HOSTS + "        bind: 0.0.0.0\n")
    assert issue.startswith("11:15: hosts.node2.rpc_servers[0].bind: binds 0.0.0.0")


def test_dns_address_needs_explicit_bind(tmp_path):
    body = HOSTS.replace("10.0.0.2", "node2.lan")
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("10:9: hosts.node2.rpc_servers[0]: needs an explicit bind: address "
                            "'node2.lan' is a DNS name")
    cluster = load_cluster(write(tmp_path, body + "        bind: 10.0.0.2\n"))
    assert cluster.host("node2").rpc_servers[0].bind == "10.0.0.2"


def test_invalid_ipv4_address(tmp_path):
    (issue,) = issues(tmp_path, HOSTS.replace("10.0.0.1", "10.0.0.300"))
    assert issue == "6:14: hosts.node1.address: '10.0.0.300' is not a valid IPv4 address"


def test_loopback_rpc_server_unreachable_from_other_host(tmp_path):
    body = HOSTS + MODELS + "network: {rpc_bind: loopback}\nservers:\n  s: {host: node1, model: m}\n"
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("15:3: servers.s.rpc: rpc-server node2:50052 listens on 127.0.0.1, "
                            "unreachable from host node1")


def test_health_budget_at_least_a_second(tmp_path):
    body = HOSTS + MODELS + "servers:\n  s:\n    host: node1\n    model: m\n" \
                            "    health: {retries: 1, interval: 0.5}\n"
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("17:5: servers.s.health: waits only 0.5 s for /health")


def test_huggingface_file_xor_files(tmp_path):
    body = HOSTS + "models:\n  m:\n    huggingface: {repo: a/b, file: x.gguf, files: [y.gguf]}\n"
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("13:5: models.m.huggingface: has both file and files")


def test_abbreviated_commit(tmp_path):
    (issue,) = issues(tmp_path, HOSTS, head="cluster: t\nllama_cpp:\n  ref: 612db6188\n")
    assert issue.startswith("3:8: llama_cpp.ref: '612db6188' looks like an abbreviated commit")


def test_an_abbreviated_commit_is_said_beside_the_files_other_problems(tmp_path):
    body = HOSTS + "servers:\n  s: {host: node1, model: nope}\n"
    found = issues(tmp_path, body, head="cluster: t\nllama_cpp:\n  ref: 612db6188\n")
    assert found[0].startswith("3:8: llama_cpp.ref: '612db6188' looks like an abbreviated commit")
    assert any("nope" in issue for issue in found[1:]), found


def test_a_ref_that_is_no_string_is_one_error(tmp_path):
    (issue,) = issues(tmp_path, HOSTS, head="cluster: t\nllama_cpp:\n  ref: 4000\n")
    assert issue.startswith("3:8: llama_cpp.ref: expected a string, got integer 4000")


# -- the model -------------------------------------------------------------------------------

def test_model_resolves_defaults_and_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    body = HOSTS.replace("10.0.0.1\n", "10.0.0.1\n    ssh: {key: keys/id, config: ~/ssh_cfg}\n"
                         "    backend: cuda\n") + \
        "models:\n  q: {ollama: {model: 'qwen3-coder:30b'}}\n" \
        "  h: {huggingface: {repo: a/b, files: [p1.gguf, p2.gguf]}}\n" \
        "servers:\n  s: {host: node1, model: q, tensor_split: [1, 2]}\n"
    path = write(tmp_path, body)
    cluster = load_cluster(path)
    node1 = cluster.host("node1")
    assert node1.ssh.key == str(tmp_path / "keys" / "id")
    assert node1.ssh.config == str(tmp_path / "home" / "ssh_cfg")
    assert node1.ssh.user is None and node1.ssh.port == 22 and node1.ssh.sudo is True
    assert node1.devices == ("CUDA0",)
    assert cluster.models["q"].source == OllamaSource("qwen3-coder", "30b", None)
    assert cluster.models["h"].source == HfSource("a/b", ("p1.gguf", "p2.gguf"), "main",
                                                  None, None)
    server = cluster.server("s")
    assert server.rpc == ("node2:50052",)
    assert server.load_mode is None and server.api_key_file is None
    assert server.tensor_split == (1.0, 2.0)
    assert cluster.devices_for(server) == ["node2:50052/CPU", "node1/CUDA0"]
    (endpoint,) = cluster.rpc_endpoints(server)
    assert endpoint.target == "10.0.0.2:50052"
    assert cluster.source_hash == hashlib.sha256(path.read_bytes()).hexdigest()
    assert hf.hub(cluster).api_endpoint == "https://huggingface.co"
    assert cluster.host("node2").rpc_servers[0].unit_name == "meshdeploy-rpc-50052"
    assert server.unit_name == "meshdeploy-server-s"


def test_same_host_loopback_endpoint_and_rpc_none(tmp_path):
    body = HOSTS + MODELS + "network: {rpc_bind: loopback}\n" \
        "servers:\n  s: {host: node2, model: m}\n"
    cluster = load_cluster(write(tmp_path, body))
    (endpoint,) = cluster.rpc_endpoints(cluster.server("s"))
    assert endpoint.address == "127.0.0.1"
    none = load_cluster(write(tmp_path, HOSTS + "models:\n  m: {path: /m.gguf}\n"
                              "servers:\n  s: {host: node1, model: m, rpc: none}\n"))
    assert none.server("s").rpc is None and none.rpc_endpoints(none.server("s")) == []
    assert isinstance(none.models["m"].source, PathSource)


@pytest.mark.parametrize("inventory", sorted((ROOT / "inventories").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_every_inventory_validates(inventory):
    text = inventory.read_text()
    assert text.startswith("# yaml-language-server: $schema=../schemas/cluster.schema.json\n")
    cluster = load_cluster(inventory)
    assert cluster.hosts and cluster.servers


def schema_objects(node, path="#"):
    if isinstance(node, dict):
        if node.get("type") == "object":
            yield path, node
        for key, value in node.items():
            yield from schema_objects(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from schema_objects(value, f"{path}/{i}")


def test_schema_documents_every_field():
    import json

    from jsonschema import Draft202012Validator

    schema = json.loads((ROOT / "schemas" / "cluster.schema.json").read_text())
    Draft202012Validator.check_schema(schema)
    assert schema["$id"] and schema["title"]
    for path, obj in schema_objects(schema):
        assert obj.get("additionalProperties") is not True, path
        assert "additionalProperties" in obj, path
        for name, prop in obj.get("properties", {}).items():
            assert prop.get("description"), f"{path}/{name}"
            assert "default" in prop or name in ("huggingface", "ollama"), f"{path}/{name}"


def test_extension_keys_carry_anchors(tmp_path):
    body = "x-ssh: &ssh {user: deploy, port: 2222}\nhosts:\n" \
           "  n: {address: 10.0.0.1, ssh: *ssh}\n  m: {address: 10.0.0.2, ssh: *ssh}\n"
    cluster = load_cluster(write(tmp_path, body))
    assert {h.ssh.port for h in cluster.hosts} == {2222}


def test_tensor_split_with_nothing_to_split(tmp_path):
    body = "hosts:\n  n: {address: 10.0.0.1}\n" + MODELS + \
        "servers:\n  s: {host: n, model: m, tensor_split: [1, 1]}\n"
    (issue,) = issues(tmp_path, body)
    assert issue.startswith("9:26: servers.s.tensor_split: is set, but the server has no devices")


def test_schema_refs_have_no_siblings():
    """Editors on draft-07 semantics (yaml-language-server) ignore keywords next to $ref."""
    import json

    schema = json.loads((ROOT / "schemas" / "cluster.schema.json").read_text())

    def walk(node, path="#"):
        if isinstance(node, dict):
            if "$ref" in node:
                assert set(node) == {"$ref"}, path
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}/{i}")

    walk(schema)


def test_more_rpc_servers_than_llama_cpp_accepts(tmp_path):
    hosts = "\n".join(f"  w{i}: {{address: 10.0.0.{i + 10}, rpc_servers: [{{port: 50052}}]}}"
                      for i in range(17))
    path = tmp_path / "big.yaml"
    path.write_text("cluster: big\nllama_cpp: {ref: b11312}\nhosts:\n  o: {address: 10.0.0.2}\n"
                    f"{hosts}\nmodels:\n  m: {{path: /m.gguf}}\nservers:\n  s: {{host: o, model: m}}\n")
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert "uses 17 rpc-servers; llama.cpp accepts at most 16 (GGML_RPC_MAX_SERVERS)" in str(err.value)


def pattern_fields(node, path=(), root=None):
    """(data path with `*` for names and `[]` for items, pattern) for every pattern in the schema."""
    root = root or node
    if "$ref" in node:
        target = root
        for part in node["$ref"].lstrip("#/").split("/"):
            target = target[part]
        node = target
    if "pattern" in node:
        yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from pattern_fields(sub, path + (name,), root)
    if isinstance(node.get("additionalProperties"), dict):
        yield from pattern_fields(node["additionalProperties"], path + ("*",), root)
    if isinstance(node.get("items"), dict):
        yield from pattern_fields(node["items"], path + (0,), root)
    for branch in node.get("anyOf", []) + node.get("oneOf", []):
        yield from pattern_fields(branch, path, root)


def test_every_pattern_has_a_human_meaning():
    import json

    from meshdeploy.config.schema import MEANING, PATTERN_MEANING, field_lookup

    schema = json.loads((ROOT / "schemas" / "cluster.schema.json").read_text())
    fields = list(pattern_fields(schema))
    assert len(fields) > 20
    for path, node in fields:
        assert node.get(MEANING) or field_lookup(PATTERN_MEANING, path), (path, node["pattern"])
