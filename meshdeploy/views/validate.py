"""`meshdeploy validate`'s answer: the file and what it holds."""

from __future__ import annotations

from meshdeploy.config.model import Cluster


def render_text(path: str, cluster: Cluster) -> str:
    """`cluster.yaml: ok (3 hosts, 2 rpc-servers, 1 model)`"""
    return (f"{path}: ok ({plural(len(cluster.hosts), 'host')}, "
            f"{plural(len(cluster.rpc_servers()), 'rpc-server')}, "
            f"{plural(len(cluster.models), 'model')})")


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
