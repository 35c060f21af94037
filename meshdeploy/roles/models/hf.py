"""Hugging Face resolution on the control machine: revision -> commit, file -> sha256 and size.

Uses huggingface_hub's own client against `huggingface.api_endpoint`, so any HF-compatible mirror
works. The token comes from the control machine (token_file, $HF_TOKEN, or huggingface_hub's
stored token) and only ever travels to hosts inside an uploaded header file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import quote as url_quote

from meshdeploy.deploy.errors import PlanError
from meshdeploy.deploy.model import HfFile, HfResolved


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
    path = cluster.huggingface.token_file
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


def resolve(cluster, model) -> HfResolved:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    src = model.source
    api_endpoint = src.endpoint or cluster.huggingface.api_endpoint
    host_endpoint = (src.endpoint or cluster.huggingface.endpoint).rstrip("/")
    api = HfApi(endpoint=api_endpoint, token=token(cluster))
    where = f"models.{model.name}.huggingface"
    try:
        info = api.model_info(src.repo, revision=src.revision, files_metadata=True, timeout=30)
    except RepositoryNotFoundError:
        raise PlanError(f"{where}: repository {src.repo} not found at {api_endpoint}",
                        hint="check the repo name (and the token for private or gated repos)") from None
    except RevisionNotFoundError:
        raise PlanError(f"{where}: revision {src.revision!r} not found in {src.repo}",
                        hint="use a branch, tag or full commit that exists") from None
    except Exception as exc:
        raise PlanError(f"{where}: cannot query {api_endpoint}: {exc.__class__.__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}",
                        hint="check network access to the endpoint, or set "
                             "huggingface.api_endpoint to a mirror the control machine reaches") from None
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
    return HfResolved(src.repo, commit, tuple(files))
