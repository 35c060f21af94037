"""Model distribution: which host gets which model bytes from whom (read from the typed model).

One internet download per Hub model: the host of its first llama-server (file order) downloads
it (`model_source`). Every other host gets its bytes from that copy over the LAN:

- a worker with a cached rpc-server that some llama-server of a one-file Hub model uses, and
  that loads no llama-server of that model itself, keeps no GGUF: it fetches the byte ranges of
  the tensors its placement holds (`tensor_fetches`; rpc_cache.seed), unless the source is
  rootless and the worker is not: then it copies the whole GGUF, whose sha256 the source
  cannot write;
- a host that keeps a whole GGUF of the model (a second orchestrator, a `fetch: false` worker)
  copies it (`copies`; models.gguf).

md-share serves that copy (core/share.py); network.allowlist opens its port to
`share_clients`.

```python
tensor_fetches(cluster)            # [Fetch("gemma27", "box16", "box11")]
keeps(cluster, cluster.host("box11"))   # []: box11 fetches its tensors, keeps no GGUF
```
"""

from __future__ import annotations

from typing import NamedTuple

from meshdeploy.config.model import Cluster, Host
from meshdeploy.config.sources import HfSource


# md-share's port on a host whose verified copy of a model other hosts copy or fetch tensors of
# (models and rpc_cache start it; network opens it to them alone; core.paths names it too).
# Below every common ephemeral range (Linux 32768-60999; macOS, the BSDs and Windows 49152-65535):
# md-share binds it afresh on each start, and a port in that range can be held at that moment by
# any outgoing connection of the host (a llama-server's to its workers lasts as long as it runs),
# which made the start fail with "Address already in use" (seen on the lab at 50180).
MODEL_SHARE_PORT = 29180


class Fetch(NamedTuple):
    """`worker` gets `model` from the copy on host `source`: its tensors (tensor_fetches) or a
    whole copy of the GGUF (copies)."""

    model: str
    source: str
    worker: str


def model_source(cluster: Cluster, name: str) -> str | None:
    """The host whose download of Hub model `name` is the cluster's one from the internet (that
    of its first llama-server, file order); None for another source, or no llama-server."""
    model = cluster.models.get(name)
    if model is None or not isinstance(model.source, HfSource):
        return None
    return next((s.host for s in cluster.servers if s.model == name), None)


def tensor_fetches(cluster: Cluster) -> list[Fetch]:
    """The workers that fetch only their tensors of a one-file Hub model, and from whom."""
    return list(cluster.derived("tensor_fetches", lambda: _tensor_fetches(cluster)))


def _tensor_fetches(cluster: Cluster) -> tuple[Fetch, ...]:
    out: dict[tuple[str, str], Fetch] = {}
    keep = set()  # (model, worker) where some cached rpc-server says fetch: false
    for server in cluster.servers:
        model = cluster.models.get(server.model)
        if model is None or not isinstance(model.source, HfSource) or len(model.source.files) != 1:
            continue
        loaders = {s.host for s in cluster.servers if s.model == server.model}
        source = model_source(cluster, server.model)
        # A rootless source makes the digest list the worker checks tensors against, and its
        # login user could rewrite the GGUF and the list together: a worker with root takes no
        # tensor from it, but keeps a whole copy, checked against the Hub's sha256 (copies).
        untrusted = source is not None and cluster.host(source).rootless
        for e in cluster.rpc_endpoints(server):
            if untrusted and not e.host.rootless:
                continue
            if e.rpc.cache and e.host.name not in loaders:
                out.setdefault((server.model, e.host.name), Fetch(server.model, source, e.host.name))
                if not e.rpc.fetch:
                    keep.add((server.model, e.host.name))
    return tuple(f for key, f in out.items() if key not in keep)


def fetched_models(cluster: Cluster, host: Host) -> list[str]:
    """Models whose tensors `host` fetches instead of keeping their GGUF."""
    return [f.model for f in tensor_fetches(cluster) if f.worker == host.name]


def shares(cluster: Cluster, host: Host) -> dict[str, list[Host]]:
    """model -> the hosts fetching its tensors from `host`'s copy (file order)."""
    out: dict[str, set[str]] = {}
    for f in tensor_fetches(cluster):
        if f.source == host.name:
            out.setdefault(f.model, set()).add(f.worker)
    return {m: [h for h in cluster.hosts if h.name in names] for m, names in out.items()}


def seeds(cluster: Cluster, host: Host) -> bool:
    """Whether md-rpc-seed runs on `host`: it writes the cache entries of a cached rpc-server,
    and the digest lists of the models `host` shares (rpc_cache.seed_tool compiles it there
    with cc; the toolchain role installs a C compiler for it)."""
    return any(r.cache for r in host.rpc_servers) or bool(shares(cluster, host))


def keeps(cluster: Cluster, host: Host) -> list[str]:
    """Models `host` keeps a whole GGUF of, in file order: those it loads, and those a cached
    rpc-server of it seeds from its own copy (`fetch: false`, an Ollama store, a path); not the
    ones whose tensors it fetches."""
    names = {s.model for s in cluster.servers if s.host == host.name}
    names |= {s.model for s in cluster.servers
              if any(e.host.name == host.name and e.rpc.cache for e in cluster.rpc_endpoints(s))}
    names -= set(fetched_models(cluster, host))
    return [m for m in cluster.models if m in names]


def copies(cluster: Cluster) -> list[Fetch]:
    """Hosts keeping a whole GGUF of a Hub model that another host downloads: they copy it from
    that host over the LAN."""
    return list(cluster.derived("copies", lambda: _copies(cluster)))


def _copies(cluster: Cluster) -> tuple[Fetch, ...]:
    out = []
    for host in cluster.hosts:
        for name in keeps(cluster, host):
            source = model_source(cluster, name)
            if source is not None and source != host.name:
                out.append(Fetch(name, source, host.name))
    return tuple(out)


def share_clients(cluster: Cluster, host: Host) -> list[Host]:
    """The hosts that get tensors or copies from `host` (file order)."""
    names = {f.worker for f in tensor_fetches(cluster) + copies(cluster) if f.source == host.name}
    return [h for h in cluster.hosts if h.name in names]


def share_sources(cluster: Cluster) -> list[Host]:
    """The hosts some other host gets model bytes from (file order)."""
    names = {f.source for f in tensor_fetches(cluster) + copies(cluster)}
    return [h for h in cluster.hosts if h.name in names]


def reverse_port(cluster: Cluster, source: str, client: str) -> int | None:
    """Where `source`'s forward to `client` listens on `client` for md-share (its reverse end),
    while the network forwards (Network.share_port: network.ssh.share_port_base + the index of
    `source` among share_sources, each sharing host's forwards on a port of their own on the
    workers); None where no bytes go that way, or nothing is forwarded."""
    if not cluster.network.forwarded:
        return None
    if not any(f.source == source and f.worker == client
               for f in tensor_fetches(cluster) + copies(cluster)):
        return None
    return cluster.network.share_port([h.name for h in share_sources(cluster)].index(source))


def derived_ports(cluster: Cluster) -> dict[tuple[str, int], str]:
    """(host, port) -> owner of the ports no line of the file names: md-share's on a sharing
    host, a forward's reverse end on a worker. Nothing while an rpc entry names an unknown
    rpc-server (the distribution cannot be read; the config checks say so)."""
    owners: dict[tuple[str, int], str] = {}
    try:
        fetches = tensor_fetches(cluster) + copies(cluster)
    except KeyError:
        return owners
    for source in share_sources(cluster):
        owners[(source.name, MODEL_SHARE_PORT)] = (
            "md-share (the model copies other hosts get from this one)")
    for f in fetches:
        port = reverse_port(cluster, f.source, f.worker)
        if port is not None:
            owners.setdefault((f.worker, port), f"the reverse end of {f.source}'s ssh forward "
                                                "(network.ssh.share_port_base)")
    return owners
