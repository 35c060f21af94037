"""What the shell offers on TAB (argcomplete calls these completers): host names and resource
addresses read from the cluster file already on the command line.

A completer never fails: a file that is missing or wrong gives the resource names alone (for
addresses) or nothing, and the command itself reports the file when it runs.
"""

from __future__ import annotations

from meshdeploy.core.loading import load_cluster
from meshdeploy.errors import MeshdeployError

# The registry (and through it the roles and pyinfra) is imported by the completers that use
# it, on TAB: the command line imports this module to build its parser.


def _cluster(parsed_args):
    path = getattr(parsed_args, "file", None)
    if not path:
        return None
    try:
        return load_cluster(path)
    except (MeshdeployError, OSError):
        return None


def complete_hosts(prefix: str, parsed_args, **_) -> list[str]:
    """--limit HOST,...: the hosts not yet named, after what is already typed."""
    cluster = _cluster(parsed_args)
    head, comma, tail = prefix.rpartition(",")
    given = set(head.split(",")) if comma else set()
    return [f"{head}{comma}{h.name}" for h in (cluster.hosts if cluster else ())
            if h.name.startswith(tail) and h.name not in given]


def complete_log_targets(prefix: str, parsed_args, **_) -> list[str]:
    """logs HOST|SERVICE: host names, the two services and the file's server names."""
    cluster = _cluster(parsed_args)
    if cluster is None:
        return []
    words = [h.name for h in cluster.hosts] + ["rpc-server", "llama-server"] + \
        [s.name for s in cluster.servers]
    return [w for w in dict.fromkeys(words) if w.startswith(prefix)]


def complete_addresses(prefix: str, parsed_args, **_) -> list[str]:
    """-target and -replace: every resource instance (models.gguf[gemma]) and each on one host
    (node2/models.gguf[gemma]); the resource names alone when the file cannot be read."""
    from meshdeploy.core import registry

    cluster = _cluster(parsed_args)
    if cluster is None:
        names = [r.qualified for r in registry.resources()]
        return [n for n in names if n.startswith(prefix)]
    slots = [s.name for s in registry.slots(cluster)]
    everything = slots + [f"{h.name}/{s}" for h in cluster.hosts for s in slots]
    return [a for a in everything if a.startswith(prefix)]
