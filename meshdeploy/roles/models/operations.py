"""models: GGUF files on the hosts that load them, downloaded with resume and verified once.

Every path is under the host's prefix (Layout.prefix: llama_cpp.prefix on a host with root, the
login user's XDG data folder on a rootless host) or the operator's own (a path, an Ollama
store); no command needs root, so a rootless host runs the same ones as that user."""

from __future__ import annotations

import base64
from pathlib import Path

from meshdeploy.config.sources import HfSource, OllamaSource, PathSource
from meshdeploy.config import distribution
from meshdeploy.core import inflight, progress, share, shell
from meshdeploy.core.context import HostContext, SecretStdin, Step, Transfer, stored_teardown
from meshdeploy.core.gguf import KNOWN_ARCHITECTURES, GgufHeaderError, architecture
from meshdeploy.core.paths import model_dir, model_files, ollama_blob
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.probe import Section
from meshdeploy.errors import PlanError
from meshdeploy.roles.models import defaults as d
from meshdeploy.roles.models import run
from meshdeploy.roles.models.facts import DiskFree, ModelFile, OllamaManifest, Stored

ROLE = "models"
TEMPLATES = Path(__file__).with_name("templates")


def needed(cluster, host) -> list[str]:
    """Models this host keeps a GGUF of (distribution.keeps): a one-file Hub model a worker only
    caches is not kept there, the worker fetches its tensors from the cluster's copy."""
    return distribution.keeps(cluster, host)


def ollama_registry_path(src: OllamaSource) -> str:
    model = src.model
    if model.count("/") == 0:
        model = f"registry.ollama.ai/library/{model}"
    elif model.count("/") == 1:
        model = f"registry.ollama.ai/{model}"
    return f"{model}/{src.tag}"


def sections(cluster, host) -> list[Section]:
    out = [Section("models.DiskFree", DiskFree, {"path": f"{host.layout.prefix}/{d.models_dir}"})]
    for name in needed(cluster, host):
        src = cluster.models[name].source
        if isinstance(src, PathSource):
            out.append(Section(f"models.ModelFile[{name}]", ModelFile, {"path": src.path}))
            continue
        if isinstance(src, OllamaSource):
            out.append(Section(f"models.OllamaManifest[{name}]", OllamaManifest,
                               {"store": src.store, "registry_path": ollama_registry_path(src)}))
        for f in model_files(cluster, name):
            path = f"{model_dir(host.layout.prefix, name)}/{f}"
            out.append(Section(f"models.ModelFile[{name}/{f}]", ModelFile, {"path": path}))
    return out


def verify_script(path: str, sha: str) -> str:
    """Hash once; on a match leave a marker (size mtime sha) that later plans trust."""
    return shell.script("set -e\n" + shell.body(TEMPLATES / "verify.sh"), prelude=shell.SHA256,
                        F=path, SHA=sha, MARKER=f"{path}{d.models_verified_suffix}")


def download_script(path: str, url: str, size: int, sha: str, auth: bool = False,
                    lan: bool = False) -> str:
    """Download with resume, check size and sha256, rename; with `auth`, curl reads the
    Authorization header from the script's standard input (see SecretStdin); `lan`: from
    another host's md-share (a refused connection, and a reply cut short, are retried)."""
    script = shell.body(TEMPLATES / "download.sh") + "\n" + shell.body(TEMPLATES / "verify.sh")
    return shell.script(script, prelude=progress.SHELL + "\n" + shell.SHA256, F=path,
                        P=f"{path}{d.models_partial_suffix}", SIZE=int(size), SHA=sha, URL=url,
                        AUTH="1" if auth else "", LAN="1" if lan else "",
                        RETRIES=int(d.models_curl_retries),
                        MARKER=f"{path}{d.models_verified_suffix}")


def _trusted(fact: dict | None, sha: str) -> bool:
    if not fact or fact["size"] is None or not fact["verified"]:
        return False
    return fact["verified"] == (fact["size"], fact["mtime"], sha)


def gguf(ctx: HostContext, name: str) -> Step:
    """models.gguf[name]: the model's files present on this host, sha256 verified."""
    cluster = ctx.cluster
    resource = f"gguf[{name}]"
    if name not in needed(cluster, ctx.host):
        return Step(ctx.change(ROLE, resource, "no-op", "not loaded on this host"))
    src = cluster.models[name].source
    if isinstance(src, PathSource):
        fact = ctx.fact(f"models.ModelFile[{name}]")
        if not fact or fact["size"] is None:
            raise PlanError(f"models.{name}.path: {src.path} does not exist on host {ctx.host.name}",
                            hint="copy the GGUF there or use a huggingface source")
        return Step(ctx.change(ROLE, resource, "no-op", f"{src.path} present"))
    if isinstance(src, OllamaSource):
        return _ollama(ctx, name, src)
    return _huggingface(ctx, name)


def _huggingface(ctx: HostContext, name: str) -> Step:
    resource = f"gguf[{name}]"
    resolved = run.of(ctx.resolved).models[name]
    commands, diffs, missing_bytes, actions = [], [], 0, set()
    # One download from the internet per model: a host that is not the model's source copies
    # the source's file over the LAN (md-share), trailing its download when both run now.
    source = distribution.model_source(ctx.cluster, name)
    copying = source is not None and source != ctx.host.name

    def url_of(f) -> str:
        return share.url(ctx.cluster, source, f.sha256, ctx.host.name) if copying else f.url
    # Only a gated or private repo gets the token (hf.resolve decided, and checked that its
    # endpoints are trusted with it). It reaches curl on standard input over the SSH channel:
    # never in arguments, a file on the host, units, logs or the plan.
    auth = resolved.auth is not None and not copying
    if auth and not run.of(ctx.resolved).hf_token:
        raise PlanError(f"models.{name}: {resolved.repo} is {resolved.auth} and no token was read",
                        hint="set huggingface.token_file or $HF_TOKEN")

    def fed(command: str) -> str:
        return SecretStdin(command, f"Authorization: Bearer {run.of(ctx.resolved).hf_token}\n") \
            if auth else command
    for f in resolved.files:
        path = f"{model_dir(ctx.prefix, name)}/{f.name}"
        fact = ctx.fact(f"models.ModelFile[{name}/{f.name}]")
        if _trusted(fact, f.sha256):
            continue
        if fact and fact["size"] == f.size:
            # Right size but no (or a stale) marker: hash it in place; download only when the
            # bytes are wrong. The subshell keeps the verify's exit from ending the command.
            actions.add("update")
            diffs.append(AttrDiff(f.name, "unverified", f"sha256 {f.sha256[:12]}"))
            commands.append(fed(inflight.guarded(
                f"models.gguf[{name}/{f.name}]",
                shell.subshell(verify_script(path, f.sha256)) + " || { "
                + shell.command("rm", "-f", path) + "; "
                + shell.subshell(download_script(path, url_of(f), f.size, f.sha256, auth,
                                                 copying)) + "; }", ctx.host.layout)))
            continue
        have = fact["size"] if fact else None
        actions.add("create" if have is None else "replace")
        resume = (fact or {}).get("partial") or 0
        missing_bytes += f.size - resume
        diffs.append(AttrDiff(f.name, None if have is None else f"{have} bytes",
                              f"{f.size} bytes, sha256 {f.sha256[:12]}",
                              forces_replacement=have is not None))
        if have is not None:
            commands.append(shell.command("rm", "-f", path, path + d.models_verified_suffix))
        commands.append(fed(inflight.guarded(f"models.gguf[{name}/{f.name}]",
                                             download_script(path, url_of(f), f.size,
                                                             f.sha256, auth, copying),
                                             ctx.host.layout)))
    serve, copiers = _serve(ctx, name, resolved)
    if not commands and not serve:
        return Step(ctx.change(ROLE, resource, "no-op", f"{name} present, sha256 verified"))
    free = ctx.fact("models.DiskFree")
    if free is not None and missing_bytes + d.models_disk_headroom_bytes > free:
        # A rootless host's prefix is the login user's XDG data folder (core.account).
        larger = "set XDG_DATA_HOME of the login user there" if ctx.host.layout.rootless \
            else "set llama_cpp.prefix"
        raise PlanError(f"host {ctx.host.name}: {name} needs {missing_bytes / 2**30:.2f} GiB more "
                        f"under {ctx.prefix}, only {free / 2**30:.2f} GiB free",
                        hint=f"free disk space or {larger} to a larger disk")
    transfer = Transfer(lan_bytes=missing_bytes if copying else 0,
                        internet_bytes=0 if copying else missing_bytes,
                        disk_bytes=missing_bytes, disk_free=free) if missing_bytes else None
    if auth:
        diffs.append(AttrDiff("token", None, f"needed ({resolved.auth}), fed to curl on stdin"))
    action = "replace" if "replace" in actions else ("create" if "create" in actions else "update")
    reason = f"{resolved.repo}@{resolved.commit[:12]}"
    if missing_bytes:
        reason += (f", {missing_bytes / 2**20:.1f} MiB to copy from {source} "
                   f"{share.way(ctx.cluster)}" if copying
                   else f", {missing_bytes / 2**20:.1f} MiB to download")
    if serve:
        reason += f"; served to {', '.join(copiers)} {share.way(ctx.cluster)} while they copy it"
        diffs.append(AttrDiff("md-share", None, f"{', '.join(copiers)}"))
    # md-share first: the copies trail this host's download as its bytes arrive.
    return Step(ctx.change(ROLE, resource, action, reason, diffs), serve + commands,
                transfer=transfer)


def _serve(ctx: HostContext, name: str, resolved) -> tuple[list[str], list[str]]:
    """(md-share's start commands, the copying hosts) when this host is `name`'s source and some
    host copying it lacks a verified file; ([], []) otherwise."""
    copiers = [ctx.cluster.host(c.worker) for c in distribution.copies(ctx.cluster)
               if c.model == name and c.source == ctx.host.name]
    lacking = [h.name for h in copiers
               if any(not _trusted(ctx.fact_of(h.name, f"models.ModelFile[{name}/{f.name}]"),
                                   f.sha256) for f in resolved.files)]
    if not lacking:
        return [], []
    folder = model_dir(ctx.prefix, name)
    names = {f.sha256: f for f in resolved.files}
    return share.start(ctx.cluster, ctx.host,
                       {n: f"{folder}/{f.name}" for n, f in names.items()},
                       copiers,
                       {n: (f"{folder}/{f.name}{d.models_partial_suffix}", f.size)
                        for n, f in names.items()}), lacking


def _ollama(ctx: HostContext, name: str, src: OllamaSource) -> Step:
    """Use the blob in place: verify its digest once, then link it; never copy gigabytes."""
    resource = f"gguf[{name}]"
    fact = ctx.fact(f"models.OllamaManifest[{name}]")
    where = f"models.{name}.ollama"
    if fact is None:
        raise PlanError(f"{where}: no manifest for {src.model}:{src.tag} in the Ollama store on "
                        f"{ctx.host.name}", hint=f"run `ollama pull {src.model}:{src.tag}` there, "
                                                 "or set the store path")
    try:
        digest, blob = ollama_blob(fact)
    except ValueError as exc:
        raise PlanError(f"{where}: the manifest on {ctx.host.name} {exc}") from None
    if digest not in fact["blobs"]:
        raise PlanError(f"{where}: blob {blob} is missing on {ctx.host.name}",
                        hint=f"run `ollama pull {src.model}:{src.tag}` again")
    _check_architecture(where, ctx.host.name, fact.get("heads", {}).get(digest))
    sha = digest.split(":", 1)[1]
    path = f"{model_dir(ctx.prefix, name)}/model.gguf"
    link = ctx.fact(f"models.ModelFile[{name}/model.gguf]")
    blob_size, blob_mtime = fact["blobs"][digest]
    marker_ok = link and link.get("verified") == (blob_size, blob_mtime, sha)
    if link and link.get("link") == blob and marker_ok:
        return Step(ctx.change(ROLE, resource, "no-op", f"{src.model}:{src.tag} linked, verified"))
    return Step(ctx.change(ROLE, resource, "create" if not link or link["size"] is None else "update",
                           "link the Ollama blob (no copy)", [AttrDiff("target", (link or {}).get("link"), blob)]),
                [shell.command("mkdir", "-p", model_dir(ctx.prefix, name), shell.AND,
                               "ln", "-sfn", blob, path),
                 verify_script(path, sha)])


def _check_architecture(where: str, host: str, head_b64: str | None) -> None:
    """Ollama ships some models under its own architecture names (seed split-guide:
    glm4moelite where upstream says deepseek2); upstream llama.cpp refuses to load those."""
    if not head_b64:
        raise PlanError(f"{where}: the model blob on {host} is not a GGUF file",
                        hint="pull the model again, or use a Hugging Face GGUF")
    try:
        arch = architecture(base64.b64decode(head_b64))
    except (ValueError, GgufHeaderError) as exc:
        raise PlanError(f"{where}: cannot read the GGUF header of the blob on {host}: {exc}") from None
    if arch is not None and arch not in KNOWN_ARCHITECTURES:
        raise PlanError(f"{where}: the blob's architecture {arch!r} is not one upstream llama.cpp "
                        "knows (an Ollama-specific name)",
                        hint="use the Hugging Face GGUF of this model instead")


def destroy(ctx: HostContext, purge: bool):
    """The model folders under the host's prefix (Layout.prefix: llama_cpp.prefix, a rootless
    host's ~/.local/share/meshdeploy)/models; only with purge (a model's bytes are expensive to
    download again). A path or Ollama source is the operator's, never touched."""
    stored = ctx.fact("models.Stored") or {}
    names = ", ".join(sorted(p.rsplit("/", 1)[-1] for p in stored))
    folder = f"{ctx.prefix}/{d.models_dir}"
    return stored_teardown(ctx, ROLE, "gguf", stored, f"models {names}", purge,
                           (shell.command("rmdir", folder, shell.QUIET, shell.OR, "true"),))


def destroy_sections(cluster, host) -> list[Section]:
    return [Section("models.Stored", Stored, {"folders": [f"{host.layout.prefix}/"
                                                          f"{d.models_dir}"]})]
