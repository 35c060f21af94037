"""A model of the cluster file and where its bytes come from: a Hugging Face repository (and
what the hub answered for it at plan time), an Ollama store, or a path on the orchestrator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class HfSource:
    repo: str
    files: tuple[str, ...]  # one file, or the parts of a split GGUF (first part is loaded)
    revision: str
    sha256: str | None  # of the single file; None = trust the hub's LFS hash
    endpoint: str | None  # None = huggingface.endpoint


@dataclass(frozen=True)
class HfFile:
    name: str
    size: int
    sha256: str
    url: str  # what the host downloads (hosts' endpoint, pinned to the commit)


@dataclass(frozen=True)
class HfResolved:
    """An HfSource as the hub answers at plan time (roles.models.hf.resolve): the revision's
    commit and each file's size and sha256; kept in the models run's `models` by model name."""

    repo: str
    commit: str
    files: tuple[HfFile, ...]
    # Why downloads need the control machine's token ("gated", "private"); None: public, and
    # no token is sent to anyone for it.
    auth: str | None = None
    # The endpoint the control machine asked (the model's own, else huggingface.api_endpoint):
    # where the plan reads the model's header from, pinned to `commit`.
    api: str = ""


@dataclass(frozen=True)
class OllamaSource:
    model: str  # "qwen3-coder"
    tag: str  # "30b"; "latest" when the file names none
    store: str | None  # None = $OLLAMA_MODELS or ~/.ollama/models on the host


@dataclass(frozen=True)
class PathSource:
    path: str  # absolute path of a GGUF already on the orchestrator host


ModelSource = Union[HfSource, OllamaSource, PathSource]


@dataclass(frozen=True)
class Model:
    name: str
    source: ModelSource
