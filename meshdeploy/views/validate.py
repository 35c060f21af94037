"""`meshdeploy validate`'s answer: the file and what it holds."""

from __future__ import annotations

from meshdeploy.config.model import Cluster
from meshdeploy.errors import ConfigError

# validate shows every error in file order up to this many; the rest are counted.
MOST_ERRORS = 20


def summary(cluster: Cluster) -> dict:
    """What a valid file holds: {"hosts": 3, "rpc_servers": 2, "models": 1}."""
    return {"hosts": len(cluster.hosts), "rpc_servers": len(cluster.rpc_servers()),
            "models": len(cluster.models)}


def render_text(path: str, cluster: Cluster) -> str:
    """`cluster.yaml: ok (3 hosts, 2 rpc-servers, 1 model)`"""
    n = summary(cluster)
    return (f"{path}: ok ({plural(n['hosts'], 'host')}, "
            f"{plural(n['rpc_servers'], 'rpc-server')}, {plural(n['models'], 'model')})")


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def render_errors(error: ConfigError, most: int = MOST_ERRORS) -> str:
    """Every issue of `error` in file order (line, column), each with its hint, at most `most`
    of them and a count of the rest: a file is fixed in one pass, top to bottom."""
    ordered = sorted(error.issues, key=lambda i: (i.line or 0, i.col or 0))
    text = "\n".join(issue.render() for issue in ordered[:most])
    rest = len(ordered) - most
    if rest > 0:
        text += f"\n... and {plural(rest, 'more error')} (fix these first)"
    return text
