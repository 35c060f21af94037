"""A cluster file made for one lab: inventories/lab.yaml names the default lab's ssh_config and
the mirror port of a lab brought up by hand; a test's own lab has its own of both."""

from __future__ import annotations

DEFAULT_SSH_CONFIG = "/var/lib/meshdeploy/lab/mdlab/ssh_config"
DEFAULT_HF_API = "http://127.0.0.1:18080"


def for_lab(text: str, info) -> str:
    """`text` (a cluster file) pointed at lab `info`'s ssh_config and Hugging Face mirror."""
    return (text.replace(DEFAULT_SSH_CONFIG, info.ssh["config"])
                .replace(DEFAULT_HF_API, info.mirrors["hf_api_endpoint"]))
