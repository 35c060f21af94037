"""One test per root cause the validate fuzzing run found (issue 10), with its minimal reproducer.

Each asserts the issue's text and its file:line:col; the CLI tests assert exit code 3 and one
clear line. Values that must stay valid (a space or a '%' in them) are at the end.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support.cli import meshdeploy

from meshdeploy.core.loading import load_cluster
from meshdeploy.errors import CONFIG, ConfigError
from meshdeploy.roles.llama_cpp import settings

# Three lines, so a snippet's first line is line 4.
HEAD = "cluster: t\nllama_cpp: {ref: b1}\nhosts: {n: {address: 10.0.0.1}}\n"
MODEL = "models: {m: {path: /m.gguf}}\n"


def refused(tmp_path: Path, body: str | bytes, head: str = HEAD):
    """The first issue of a file that must be refused, checked to name the file."""
    path = tmp_path / "c.yaml"
    if isinstance(body, bytes):
        path.write_bytes(head.encode() + body)
    else:
        path.write_text(head + body)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    issue = info.value.issues[0]
    assert issue.file == str(path)
    return issue


def at(issue) -> tuple:
    return issue.line, issue.col, issue.path


# -- constructor errors that escaped the try ------------------------------------------------

def test_bool_tag_on_a_non_boolean(tmp_path):
    issue = refused(tmp_path, "x-a: !!bool x\n")
    assert at(issue) == (4, 6, "x-a")
    assert issue.message == "'x' is not a valid !!bool"


def test_merge_key_with_a_scalar(tmp_path):
    issue = refused(tmp_path, "x-a:\n  <<: 5\n")
    assert (issue.line, issue.col) == (5, 7)
    assert "expected a mapping or list of mappings for merging" in issue.message


def test_set_tag(tmp_path):
    issue = refused(tmp_path, "x-a: !!set {a, b}\n")
    assert at(issue) == (4, 6, "x-a")
    assert issue.message == "tag !!set is not supported"


@pytest.mark.parametrize("tag", ["!!binary aGVsbG8=", "!!python/object:os.system x",
                                 "!!omap [{a: 1}]", "!foo bar"])
def test_other_tags(tmp_path, tag):
    issue = refused(tmp_path, f"x-a: {tag}\n")
    assert at(issue) == (4, 6, "x-a")
    assert issue.message.startswith("tag !") and issue.message.endswith("is not supported")


def test_integer_over_python_digit_limit(tmp_path):
    issue = refused(tmp_path, "x-a: " + "1" * 4301 + "\n")
    assert at(issue) == (4, 6, "x-a")
    assert issue.message == "integer with more than 4,300 digits"


def test_yaml_1_3_directive(tmp_path):
    issue = refused(tmp_path, "", head="%YAML 1.3\n---\n" + HEAD)
    assert (issue.line, issue.col) == (1, 1)
    assert issue.message == "%YAML 1.3 is not supported"


def test_thousand_deep_nesting(tmp_path):
    issue = refused(tmp_path, "x-a: " + "[" * 1000 + "]" * 1000 + "\n")
    assert (issue.line, issue.col) == (4, 6)
    assert issue.message == "values nested deeper than 64 levels"
    block = "".join("  " * i + "- \n" for i in range(100))  # block style: the composer refuses
    issue = refused(tmp_path, "x-a:\n" + block)
    assert issue.line == 5 + 63 and issue.message == "values nested deeper than 64 levels"


# -- aliases -------------------------------------------------------------------------------

def test_recursive_alias(tmp_path):
    issue = refused(tmp_path, "x: &a [*a]\n")
    assert at(issue) == (4, 8, "x[0]")
    assert issue.message == "alias *a is inside its own anchor &a"


def test_alias_bomb_names_the_alias(tmp_path):
    # The fuzzing run's bomb: 9 levels of 10x, a billion values once expanded (took 13-21 s).
    lines = ["a: &a [" + ", ".join(['"lol"'] * 10) + "]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    bomb = "\n".join(lines) + "\n"
    assert len(bomb) < 600
    issue = refused(tmp_path, bomb, head="")
    assert issue.message == "alias *d expands the file past 100,000 values"
    assert issue.hint == "aliases that nest aliases multiply: is this a YAML alias bomb?"
    assert (issue.line, issue.col, issue.path) == (5, 36, "e[7]")


def test_hundred_thousand_item_flow_list(tmp_path):
    issue = refused(tmp_path, "x-a: [" + ",".join(["1"] * 100_000) + "]\n")
    assert issue.message == "the file has more than 10,000 values"
    assert issue.line == 4 and issue.path.startswith("x-a[")


def test_anchors_under_extension_keys_still_work(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("x-ssh: &ssh {user: deploy}\ncluster: t\nllama_cpp: {ref: b1}\n"
                    "hosts:\n  n: {address: 10.0.0.1, ssh: *ssh}\n"
                    "  m: {address: 10.0.0.2, ssh: *ssh}\n")
    assert {h.ssh.user for h in load_cluster(path).hosts} == {"deploy"}


# -- keys and numbers ------------------------------------------------------------------------

def test_complex_key(tmp_path):
    issue = refused(tmp_path, "? [a, b]\n: 1\n")
    assert (issue.line, issue.col) == (4, 3)
    assert issue.message == "mapping key a list; keys must be strings"


@pytest.mark.parametrize("key, kind", [("null", "null"), ("1", "int"), ("true", "bool")])
def test_non_string_keys(tmp_path, key, kind):
    issue = refused(tmp_path, f"{key}: x\n")
    assert (issue.line, issue.col) == (4, 1)
    assert issue.message.startswith(f"mapping key '{key}' is a")
    assert issue.message.endswith(f"{kind}; keys must be strings")
    assert issue.hint == f"quote it: '{key}'"


def test_integer_field_refuses_a_float(tmp_path):
    issue = refused(tmp_path, "", head=HEAD.replace("10.0.0.1}", "10.0.0.1, rpc_servers: "
                                                                 "[{port: 50052.0}]}"))
    assert at(issue) == (3, 53, "hosts.n.rpc_servers[0].port")
    assert issue.message == "expected an integer, got number 50052.0"
    assert issue.hint == "write it without the fraction: 50052"


def test_number_field_refuses_nan_and_inf(tmp_path):
    body = MODEL + "servers: {s: {host: n, model: m, rpc: none, tensor_split: [%s]}}\n"
    issue = refused(tmp_path, body % ".nan, .inf")  # oneOf: the best of the two is reported
    assert at(issue) == (5, 66, "servers.s.tensor_split[1]")
    assert issue.message == "inf is not a finite number"
    issue = refused(tmp_path, body % "1, .nan")
    assert at(issue) == (5, 63, "servers.s.tensor_split[1]")
    assert issue.message == "nan is not a finite number"


def test_number_field_refuses_a_boolean(tmp_path):
    issue = refused(tmp_path, MODEL + "servers: {s: {host: n, model: m, health: "
                                      "{interval: true}}}\n")
    assert issue.path == "servers.s.health.interval"
    assert issue.message == "expected a number, got boolean true"


# -- the file itself -------------------------------------------------------------------------

def run_cli(path: Path) -> subprocess.CompletedProcess:
    return meshdeploy("validate", path, timeout=60)


def test_dev_zero_is_refused_at_once():
    done = run_cli(Path("/dev/zero"))
    assert done.returncode == CONFIG
    assert done.stderr.splitlines()[0] == "/dev/zero: cannot read: a character device"


def test_ten_megabytes(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (10 << 20))
    issue = refused_path(big)
    assert (issue.line, issue.message) == (0, "is larger than 1 MiB; a cluster file is a few KB")


def refused_path(path: Path):
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    return info.value.issues[0]


def test_directory(tmp_path):
    done = run_cli(tmp_path)
    assert done.returncode == CONFIG
    assert done.stderr.splitlines()[0] == f"{tmp_path}: cannot read: is a directory"


def test_empty_file(tmp_path):
    (tmp_path / "e.yaml").write_bytes(b"")
    done = run_cli(tmp_path / "e.yaml")
    assert done.returncode == CONFIG
    assert done.stderr.splitlines()[0] == \
        f"{tmp_path / 'e.yaml'}:1:1: the cluster file is empty; expected a mapping"


def test_binary_junk(tmp_path):
    issue = refused(tmp_path, b"cluster: t\n" + bytes(range(256)), head="")
    assert (issue.line, issue.col) == (2, 1)
    assert issue.message == "file contains a NUL byte: this looks like a binary file"


def test_not_utf8(tmp_path):
    issue = refused(tmp_path, "cluster: caf\u00e9\n".encode("latin-1"), head="")
    assert (issue.line, issue.col) == (1, 13)
    assert issue.message == "file is not valid UTF-8 (byte 0xe9)"


def test_raw_control_character_is_located(tmp_path):
    # ruamel's ReaderError says only "position 25".
    issue = refused(tmp_path, "x-a: 'a\x07b'\n")
    assert (issue.line, issue.col) == (4, 8)
    assert issue.message == "file contains control character U+0007, which YAML does not allow"


def test_ruamel_warning_stays_off_stderr(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(HEAD + "x-a: &x 1\nx-b: &x 2\n")  # ReusedAnchorWarning
    done = run_cli(path)
    assert done.returncode == 0 and done.stderr == ""


def test_every_failure_is_exit_3_with_one_clear_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(HEAD + "x: &a [*a]\n")
    done = run_cli(bad)
    assert done.returncode == CONFIG
    assert done.stderr.splitlines() == [
        f"{bad}:4:8: x[0]: alias *a is inside its own anchor &a",
        "  hint: a cluster file cannot hold a recursive structure: copy the values"]


# -- the semantic checks read the distribution of a file they refuse --------------------------

# Found by a fuzzing run (1 internal error in 3,543 files): an rpc-server on a host whose address
# is not IPv4 has no bind until the checks ask for one, and the distribution the port check
# reads dialled it (AttributeError: 'NoneType' object has no attribute 'startswith').
NO_BIND = """cluster: "b"
llama_cpp:
 ref: L
hosts:
  i:
    address: "1"
    ssh:
     user: n
  x:
    address: "5"
    rpc_servers:
    - {port: 2}
models:
 m:
  huggingface:
   repo: "h/L"
servers:
 n:
    host: i
    model: m
"""

# Found by the generator of files shaped like a cluster file: under transport: ssh the port
# check listed the forwards of an rpc entry naming an unknown host (KeyError).
UNKNOWN_WORKER_OVER_SSH = """cluster: b
llama_cpp: {ref: L}
hosts:
  i: {address: 10.0.0.1}
models: {m: {path: /m.gguf}}
servers:
  n: {host: i, model: m, rpc: ["nowhere:1"]}
network: {transport: ssh}
"""


def test_an_rpc_server_without_a_bind_is_reported_not_dialled(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(NO_BIND)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    issues = {(i.line, i.col, i.path): i.message for i in info.value.issues}
    assert issues[(12, 7, "hosts.x.rpc_servers[0]")].startswith(
        "needs an explicit bind: address '5' is a DNS name")
    done = run_cli(path)
    assert done.returncode == CONFIG, done.stderr
    assert done.stderr.startswith(f"{path}:6:14: hosts.i.address: ")
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr


def test_an_unknown_worker_under_the_ssh_transport_is_reported(tmp_path):
    issue = refused(tmp_path, "", head=UNKNOWN_WORKER_OVER_SSH)
    path = tmp_path / "c.yaml"
    assert at(issue) == (7, 32, "servers.n.rpc[0]")
    assert issue.message == "unknown host 'nowhere' in 'nowhere:1'"
    done = run_cli(path)
    assert done.returncode == CONFIG, done.stderr
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr


# -- values that would reach a root shell or a unit file -------------------------------------

def test_escaped_newline_in_extra_args(tmp_path):
    issue = refused(tmp_path, MODEL + 'servers: {s: {host: n, model: m, rpc: none, '
                                      'extra_args: ["x\\nExecStartPre=+/bin/sh"]}}\n')
    assert at(issue) == (5, 58, "servers.s.extra_args[0]")
    assert issue.message == "contains a newline"


def test_block_scalar_newline_gets_a_hint(tmp_path):
    issue = refused(tmp_path, MODEL + "servers:\n  s:\n    host: n\n    model: m\n"
                                      "    extra_args:\n      - |\n        --foo\n")
    assert at(issue) == (10, 9, "servers.s.extra_args[0]")
    assert "use |- or >-" in issue.hint


def test_apt_proxy_injection(tmp_path):
    issue = refused(tmp_path, "toolchain: {apt_proxy: 'http://x\"; APT::Update::Pre-Invoke "
                              "{\"sh\";};'}\n")
    assert at(issue) == (4, 24, "toolchain.apt_proxy")
    assert "is not an http:// or https:// proxy URL" in issue.message


def test_repo_option_injection(tmp_path):
    issue = refused(tmp_path, "", head=HEAD.replace("{ref: b1}", "{ref: b1, repo: "
                                                    "'--upload-pack=touch /tmp/x'}"))
    assert at(issue) == (2, 28, "llama_cpp.repo")
    assert issue.message.startswith("'--upload-pack=touch /tmp/x' is not a git URL")


@pytest.mark.parametrize("repo", ["ext::sh -c touch% /tmp/x", "ssh://-oProxyCommand=x/y",
                                  "x", "https://a b"])
def test_repo_refuses_transports_and_options(tmp_path, repo):
    issue = refused(tmp_path, "", head=HEAD.replace("{ref: b1}", f"{{ref: b1, repo: '{repo}'}}"))
    assert issue.path == "llama_cpp.repo"


def test_ref_option_injection(tmp_path):
    issue = refused(tmp_path, "", head=HEAD.replace("{ref: b1}", "{ref: '--upload-pack=x'}"))
    assert at(issue) == (2, 18, "llama_cpp.ref")
    assert issue.message.startswith("'--upload-pack=x' is not a git tag, branch or commit")


@pytest.mark.parametrize("ref", ["a..b", "x@{1}", "v1.lock", "x/", "x.", ".x", "a b"])
def test_ref_follows_check_ref_format(tmp_path, ref):
    issue = refused(tmp_path, "", head=HEAD.replace("{ref: b1}", f"{{ref: '{ref}'}}"))
    assert issue.path == "llama_cpp.ref"


def test_model_file_outside_the_repository(tmp_path):
    issue = refused(tmp_path, "models: {m: {huggingface: {repo: a/b, file: ../../etc/passwd}}}\n")
    assert at(issue) == (4, 45, "models.m.huggingface.file")
    assert issue.message.startswith("'../../etc/passwd' is not a file in the repository")


def test_server_bind_injection(tmp_path):
    issue = refused(tmp_path, MODEL + "servers: {s: {host: n, model: m, rpc: none, "
                                      "bind: '1.2.3.4; reboot'}}\n")
    assert at(issue) == (5, 51, "servers.s.bind")
    assert issue.message == "'1.2.3.4; reboot' is not an IPv4 address or host name"


@pytest.mark.parametrize("bind, col", [("0.0.0.0", 51), ("10.0.0.1", 51),
                                       ("llm.example.org", 51)])
def test_server_off_loopback_without_a_key(tmp_path, bind, col):
    issue = refused(tmp_path, MODEL + "servers: {s: {host: n, model: m, rpc: none, "
                                      f"bind: {bind}}}}}\n")
    assert at(issue) == (5, col, "servers.s.bind")
    assert issue.message == (f"listens on {bind} without an API key: anyone who reaches "
                             "port 8080 can use the model")
    assert "api_key_file" in issue.hint and "allow_unauthenticated: true" in issue.hint


def test_server_off_loopback_without_a_key_refused_by_the_cli(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(HEAD + MODEL + "servers: {s: {host: n, model: m, rpc: none, "
                                   "bind: 0.0.0.0}}\n")
    done = run_cli(path)
    assert done.returncode == CONFIG, done.stderr
    assert done.stderr.startswith(f"{path}:5:51: servers.s.bind: listens on 0.0.0.0 without "
                                  "an API key")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("value", ["true", "ask", "off", "'Yes '"])
def test_host_key_takes_three_values(tmp_path, value):
    head = HEAD.replace("{address: 10.0.0.1}", f"{{address: 10.0.0.1, ssh: {{host_key: {value}}}}}")
    issue = refused(tmp_path, "", head=head)
    assert issue.path == "hosts.n.ssh.host_key"
    assert "yes, accept-new, no" in issue.message or "accept-new" in issue.message


@pytest.mark.parametrize("field, value", [
    ("prefix", "/opt/../etc"), ("prefix", "opt"), ("prefix", "/opt/"), ("prefix", "//opt")])
def test_paths_are_absolute_and_normalized(tmp_path, field, value):
    head = HEAD.replace("{ref: b1}", f"{{ref: b1, {field}: '{value}'}}")
    issue = refused(tmp_path, "", head=head)
    assert issue.path == f"llama_cpp.{field}"
    assert "is not an absolute, normalized path" in issue.message


def test_control_character_in_a_key_is_escaped_in_the_message(tmp_path):
    issue = refused(tmp_path, '"x-\\e[31m": 1\n')
    assert issue.path == "x-\\x1b[31m" and issue.message == "contains control character U+001B"


# -- legitimate values stay valid ------------------------------------------------------------

def test_space_and_percent_stay_valid(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cluster: t\nllama_cpp: {ref: b1, prefix: /opt/my models}\n"
                    "hosts: {n: {address: 10.0.0.1}}\n" + MODEL +
                    'servers: {s: {host: n, model: m, rpc: none, '
                    'extra_args: ["--alias", "50% off"]}}\n')
    cluster = load_cluster(path)
    assert cluster.prefix == settings.of(cluster).prefix == "/opt/my models"
    assert cluster.server("s").extra_args == ("--alias", "50% off")


@pytest.mark.parametrize("repo", ["https://github.com/ggml-org/llama.cpp.git",
                                  "git://10.200.0.1/llama.cpp.git",
                                  "git@github.com:ggml-org/llama.cpp.git",
                                  "ssh://git@host:2222/llama.cpp.git", "file:///srv/llama.cpp",
                                  "/srv/git/llama.cpp"])
def test_real_repos_stay_valid(tmp_path, repo):
    path = tmp_path / "c.yaml"
    path.write_text(HEAD.replace("{ref: b1}", f"{{ref: release/b1, repo: '{repo}'}}"))
    assert settings.of(load_cluster(path)).repo == repo


def test_off_loopback_with_a_key_or_allowed_stays_valid(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(HEAD + "models: {m: {path: /m.gguf}, m2: {path: /m2.gguf}}\n"
                    "servers:\n"
                    "  s: {host: n, model: m, rpc: none, bind: 0.0.0.0, port: 8080,\n"
                    "      api_key_file: /etc/meshdeploy/key, allow: [10.0.0.0/8]}\n"
                    "  o: {host: n, model: m2, rpc: none, bind: 10.0.0.1, port: 8081,\n"
                    "      allow_unauthenticated: true, allow: [10.0.0.0/8]}\n")
    cluster = load_cluster(path)
    assert cluster.server("o").allow_unauthenticated
    assert not cluster.server("s").allow_unauthenticated
    done = run_cli(path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ("warning: llama-server o on n listens on 10.0.0.1:8081 without an "
                           "API key (allow_unauthenticated: true); anyone who reaches the port "
                           "can use the model. Set servers.o.api_key_file or bind 127.0.0.1.\n")


def test_ollama_model_name_cannot_leave_the_store(tmp_path):
    issue = refused(tmp_path, "models: {m: {ollama: {model: 'library/../../../etc/passwd'}}}\n")
    assert at(issue) == (4, 30, "models.m.ollama.model")
    assert "is not an Ollama model name" in issue.message
