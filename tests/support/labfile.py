"""A cluster file made for one lab: inventories/lab.yaml names the default lab's ssh_config and
the mirror port of a lab brought up by hand; a test's own lab has its own of both."""

from __future__ import annotations

from pathlib import Path

DEFAULT_SSH_CONFIG = "/var/lib/meshdeploy/lab/mdlab/ssh_config"
DEFAULT_HF_API = "http://127.0.0.1:18080"
INVENTORIES = Path(__file__).resolve().parents[2] / "inventories"


def for_lab(text: str, info) -> str:
    """`text` (a cluster file) pointed at lab `info`'s ssh_config and Hugging Face mirror."""
    return (text.replace(DEFAULT_SSH_CONFIG, info.ssh["config"])
                .replace(DEFAULT_HF_API, info.mirrors["hf_api_endpoint"]))


def lab_text(info, inventory: str = "lab.yaml") -> str:
    """inventories/`inventory` as lab `info` runs it."""
    return for_lab((INVENTORIES / inventory).read_text(), info)


def without_host(text: str, name: str) -> str:
    """The cluster file `text` without host `name` (a host of inventories/lab.yaml's `hosts:`,
    whose entries end at the next host or at `models:`)."""
    start = text.index(f"  {name}:\n")
    ends = [i for i in (text.find("\n  node", start + 1), text.index("\nmodels:\n", start))
            if i != -1]
    return text[:start] + text[min(ends) + 1:]


def write_lab_file(info, folder: Path, inventory: str = "lab.yaml",
                   text: str | None = None) -> Path:
    """inventories/`inventory` as lab `info` runs it (or `text`), written into `folder` under the
    inventory's name: its lock, state and plan files land beside it, not in inventories/."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / inventory
    target.write_text(lab_text(info, inventory) if text is None else text)
    return target
