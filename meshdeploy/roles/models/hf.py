"""Hugging Face resolution on the control machine: revision -> commit, file -> sha256 and size.

Uses huggingface_hub's own client against `huggingface.api_endpoint`, so any HF-compatible mirror
works. Every repository is asked about anonymously first; the token (token_file, $HF_TOKEN, or
huggingface_hub's stored token) is read and used only for a repository that needs it (gated, or
private: invisible without it), and only when every endpoint it would go to is https or listed
in huggingface.trusted_http_endpoints. HfResolved.auth records the need, so the plan can say so.
A listed http endpoint is the operator's choice; a redirect is not: no client that carries the
token follows a redirect with it to another scheme, host or port (huggingface_hub's httpx client
here, curl on the hosts, the placement's header fetch: tests/unit/test_hf_redirect.py), so an
https endpoint that redirects to http, even on its own host and port, never gets it in clear text.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote as url_quote

from meshdeploy.config.document import Document
from meshdeploy.config.load import control_path
from meshdeploy.config.sources import HfFile, HfResolved
from meshdeploy.errors import ConfigError, PlanError

SECTION = "huggingface"  # this role's second section of the cluster file (schema.huggingface.json)


@dataclass(frozen=True)
class Hub:
    """The `huggingface:` section as the role uses it."""

    endpoint: str  # what hosts download from
    api_endpoint: str  # what the control machine queries (endpoint when unset)
    token_file: str | None  # control-machine path, ~ expanded; None = $HF_TOKEN / default file
    # http:// endpoints a token may travel to in clear text (https ones always may), no "/" at
    # the end; a token is sent to no other http:// endpoint.
    trusted_http_endpoints: tuple[str, ...] = ()


def hub(cluster) -> Hub:
    """The cluster's `huggingface:` settings (defaults filled by the schema), made once per
    Cluster (Cluster.derived): every model's resolution and trust check reads them."""
    def make() -> Hub:
        s = cluster.sections[SECTION]
        return Hub(endpoint=s["endpoint"], api_endpoint=s["api_endpoint"] or s["endpoint"],
                   token_file=control_path(s["token_file"], cluster.path.parent),
                   trusted_http_endpoints=tuple(e.rstrip("/")
                                                for e in s["trusted_http_endpoints"]))

    return cluster.derived(SECTION, make)


# The Hub's answers are untrusted input: a hostile or compromised mirror must not reach a shell,
# a path on a host or a file name on the control machine through them.
SHA256 = re.compile(r"[0-9a-f]{64}")
COMMIT = re.compile(r"[0-9a-f]{40}")
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=@,-]*")


def safe_relative_path(name) -> bool:
    """A relative path of plain segments: no '..', no absolute path, no empty segment."""
    return isinstance(name, str) and len(name) <= 1024 and \
        all(_SEGMENT.fullmatch(part) for part in name.split("/"))


def _checked(where: str, endpoint: str, what: str, value, ok: bool):
    if not ok:
        raise PlanError(f"{where}: {endpoint} answered {what} {value!r}, which is not valid",
                        hint="the endpoint is not a Hugging Face API, or it is compromised; "
                             "check huggingface.api_endpoint")
    return value


def token(cluster) -> str | None:
    path = hub(cluster).token_file
    if path:
        try:
            return Path(path).read_text().strip() or None
        except OSError as exc:
            raise PlanError(f"cannot read huggingface.token_file {path}: {exc.strerror}",
                            hint="fix the path or unset it to use $HF_TOKEN") from None
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # an unreadable token store means "no token", not a failed plan
        return None


def trusted(cluster, url: str) -> bool:
    """Whether a token may be sent to `url`: https, or an http endpoint the file lists."""
    return url.startswith("https://") or \
        url.rstrip("/") in hub(cluster).trusted_http_endpoints


def endpoints(cluster, src) -> tuple[str, str]:
    """(the control machine's API endpoint, the hosts' download endpoint) of a Hub source."""
    settings = hub(cluster)
    return (src.endpoint or settings.api_endpoint).rstrip("/"), \
        (src.endpoint or settings.endpoint).rstrip("/")


def check_trust(cluster, model, auth: str) -> None:
    """Refuse, at the cluster file's line, to send the token to an untrusted http endpoint."""
    api, hosts = endpoints(cluster, model.source)
    for url, key in ((api, "api_endpoint"), (hosts, "endpoint")):
        if trusted(cluster, url):
            continue
        path = ("huggingface", key)
        doc = Document.read(cluster.path)
        if model.source.endpoint:
            path = ("models", model.name, "huggingface", "endpoint")
        elif doc.written(path) is None:  # api_endpoint defaults to endpoint
            path = ("huggingface", "endpoint")
        raise ConfigError([doc.issue(
            path, f"models.{model.name} is {auth} and needs the Hugging Face token, which would "
                  f"go to {url} in clear text",
            "use an https endpoint, or add it to huggingface.trusted_http_endpoints if nobody "
            "else can read that network")])


def _info(api, src, where: str, api_endpoint: str, authenticated: bool):
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        return api.model_info(src.repo, revision=src.revision, files_metadata=True, timeout=30)
    except RevisionNotFoundError:
        raise PlanError(f"{where}: revision {src.revision!r} not found in {src.repo}",
                        hint="use a branch, tag or full commit that exists") from None
    except Exception as exc:
        if _not_found(exc):
            if not authenticated:
                raise
            raise PlanError(f"{where}: repository {src.repo} not found at {api_endpoint}, "
                            "even with the token",
                            hint="check the repo name and that the token may read it") from None
        raise PlanError(f"{where}: cannot query {api_endpoint}: {exc.__class__.__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}",
                        hint="check network access to the endpoint, or set "
                             "huggingface.api_endpoint to a mirror the control machine reaches") from None


def _not_found(exc: Exception) -> bool:
    from huggingface_hub.errors import RepositoryNotFoundError  # GatedRepoError is one too

    return isinstance(exc, RepositoryNotFoundError)


def resolve(cluster, model, get_token=token) -> HfResolved:
    """The model's commit, files, sizes and sha256s, and whether it needs the token.

    + get_token(cluster) -> str | None: called only for a repository that needs a token
    """
    from huggingface_hub import HfApi

    src = model.source
    api_endpoint, host_endpoint = endpoints(cluster, src)
    where = f"models.{model.name}.huggingface"
    # token=False: huggingface_hub would otherwise send $HF_TOKEN or its stored token to any
    # endpoint, for public repositories too.
    try:
        info = _info(HfApi(endpoint=api_endpoint, token=False), src, where, api_endpoint, False)
        auth = "gated" if getattr(info, "gated", None) else None
    except Exception as exc:
        if not _not_found(exc):
            raise
        info, auth = None, "private"  # or absent: only the token can tell
    if auth:
        check_trust(cluster, model, auth)
        secret = get_token(cluster)
        if not secret:
            raise PlanError(f"{where}: {src.repo} at {api_endpoint} is not found anonymously"
                            if auth == "private" else
                            f"{where}: {src.repo} is gated: downloads need a token",
                            hint="check the repo name; for a private or gated repo set "
                                 "huggingface.token_file or $HF_TOKEN")
        if info is None:
            info = _info(HfApi(endpoint=api_endpoint, token=secret), src, where, api_endpoint,
                         True)
    commit = _checked(where, api_endpoint, "commit", info.sha,
                      isinstance(info.sha, str) and bool(COMMIT.fullmatch(info.sha)))
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    files = []
    for name in src.files:
        _checked(where, api_endpoint, "file name", name, safe_relative_path(name))
        s = siblings.get(name)
        if s is None:
            near = [n for n in siblings if isinstance(n, str) and n.endswith(".gguf")][:5]
            raise PlanError(f"{where}: file {name!r} is not in {src.repo}@{commit[:12]}",
                            hint=f"GGUF files there: {', '.join(near) or 'none'}")
        sha = s.lfs.sha256 if s.lfs else None
        if not sha:
            raise PlanError(f"{where}: the hub gives no sha256 for {name}",
                            hint="set models.<name>.huggingface.sha256 to pin it")
        _checked(where, api_endpoint, f"sha256 of {name}", sha,
                 isinstance(sha, str) and bool(SHA256.fullmatch(sha)))
        size = s.size or (s.lfs.size if s.lfs else None)
        _checked(where, api_endpoint, f"size of {name}", size,
                 isinstance(size, int) and not isinstance(size, bool) and size >= 0)
        url = f"{host_endpoint}/{url_quote(src.repo, safe='/')}/resolve/{commit}/" \
              f"{url_quote(name, safe='/')}"
        if not url.startswith(("http://", "https://")):
            raise PlanError(f"{where}: download URL {url!r} is not http(s)",
                            hint="set huggingface.endpoint to an http(s) URL")
        files.append(HfFile(name, size, sha, url))
    if src.sha256 and len(files) == 1 and files[0].sha256 != src.sha256:
        raise PlanError(f"{where}: the hub's sha256 of {files[0].name} is {files[0].sha256}, "
                        f"the cluster file pins {src.sha256}",
                        hint="the file changed upstream: check it, then update the pin")
    return HfResolved(src.repo, commit, tuple(files), auth, api_endpoint)
