"""monitoring: the Prometheus configuration of a cluster, as data (views/prometheus.py writes it
as YAML through a YAML library, never by joining strings).

Pure: the cluster model in, mappings out; nothing here talks to a host. Three kinds of target:

- every llama-server's /metrics (it runs with --metrics), with its API key read from a file
  (`authorization: {credentials_file: keys/NAME}`, as Prometheus reads bearer tokens), one scrape
  job per server since the credentials belong to the job;
- every rpc-server's port, through the blackbox exporter's TCP connect (blackbox.yml);
- the SSH port of every host with an rpc-server, the same way: whether the host answers.

Why two probes for a worker: rpc-server serves one client at a time and listens with a backlog of
1 (ggml-rpc's transport.cpp: listen(sockfd, 1)). While its llama-server holds the connection, a
probe's connect completes in the kernel's accept queue, and once two wait there (closed probes
stay queued until rpc-server accepts them) every further SYN is dropped: the connect times out.
A stopped rpc-server refuses at once. So the recording rule meshdeploy:rpc_server_up counts an
rpc-server up when its probe connected, or timed out while its host's SSH port answered; down
when the connect was refused (nothing listens) or the host does not answer. A probe's closed
connection holds no resource of the worker: rpc-server reads EOF from it the next time it
accepts, before the connection of a restarted llama-server.

```python
config(cluster, interval=15, blackbox="127.0.0.1:9115")   # the mapping of prometheus.yml
key_files(cluster)    # [KeyFile("main", "node1", "/etc/meshdeploy/main.key", "keys/main")]
skipped(cluster)      # ["llama-server main on node1 binds 127.0.0.1: ..."]
```
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from meshdeploy.config.addresses import WILDCARD, is_loopback
from meshdeploy.roles.monitoring import defaults as d

SECTION = "monitoring"  # the role's section of the cluster file (schema.json)

# What `meshdeploy prometheus` says when the section names no scraper.
NO_SCRAPERS = ("monitoring.scrapers is empty: every host's allow-list drops the scrapers until "
               "the cluster file names them and an apply loads it")


@dataclass(frozen=True)
class Target:
    kind: str  # "llama-server", "rpc-server", "host"
    host: str
    address: str  # "10.200.0.11:8080", "[fd00::2]:50052"
    labels: dict  # the target's labels besides job and instance
    job_name: str  # unique in prometheus.yml
    key_file: str | None = None  # a llama-server's api_key_file, on its host


@dataclass(frozen=True)
class KeyFile:
    """A credentials file Prometheus reads: the API key of `server`, kept on `host` at
    `source`, to be copied to `path` (relative to prometheus.yml's folder)."""

    server: str
    host: str
    source: str
    path: str


def scrapers(cluster) -> list[str]:
    """monitoring.scrapers as written (cluster_file.py: each an address or network)."""
    return list(cluster.sections[SECTION]["scrapers"])


def _hostport(address: str, port: int) -> str:
    try:
        if ipaddress.ip_address(address).version == 6:
            return f"[{address}]:{port}"
    except ValueError:
        pass  # a DNS name: Prometheus resolves it
    return f"{address}:{port}"


def _reachable(bind: str | None, host, tunnel: bool) -> tuple[str | None, str]:
    """(address a scraper dials, or None; why not)."""
    if bind is not None and is_loopback(bind):
        return None, f"binds {bind}, which only the host itself reaches"
    if tunnel:
        return None, "listens inside the WireGuard tunnel (network.transport: wireguard)"
    if bind is None or bind in (WILDCARD, "::"):
        return host.address, ""
    return bind, ""


def _targets(cluster) -> tuple[list[Target], list[str]]:
    targets: list[Target] = []
    notes: list[str] = []
    name = cluster.name
    for server in cluster.servers:
        host = cluster.host(server.host)
        address, why = _reachable(server.bind, host, False)
        if address is None:
            notes.append(f"llama-server {server.name} on {host.name} {why} (give "
                         f"servers.{server.name} a bind the scrapers reach)")
            continue
        targets.append(Target("llama-server", host.name, _hostport(address, server.port),
                              {"cluster": name, "host": host.name, "server": server.name},
                              f"meshdeploy-{name}-llama-server-{server.name}",
                              server.api_key_file))
    probed = []
    for host in cluster.hosts:
        for rpc in host.rpc_servers:
            address, why = _reachable(rpc.bind, host, cluster.network.tunnel)
            if cluster.network.forwarded:
                address, why = None, ("listens on loopback behind SSH forwards "
                                      "(network.transport: ssh)")
            if address is None:
                notes.append(f"rpc-server :{rpc.port} on {host.name} {why}")
                continue
            targets.append(Target("rpc-server", host.name, _hostport(address, rpc.port),
                                  {"cluster": name, "host": host.name, "port": str(rpc.port)},
                                  f"meshdeploy-{name}-rpc-server"))
            if host.name not in probed:
                probed.append(host.name)
    for host in (cluster.host(n) for n in probed):
        targets.append(Target("host", host.name, _hostport(host.address, host.ssh.port),
                              {"cluster": name, "host": host.name},
                              f"meshdeploy-{name}-host"))
    return targets, notes


def targets(cluster) -> list[Target]:
    return cluster.derived("monitoring targets", lambda: _targets(cluster))[0]


def skipped(cluster) -> list[str]:
    """Why a service of the cluster gets no target (loopback binds, tunnels, forwards)."""
    return cluster.derived("monitoring targets", lambda: _targets(cluster))[1]


def key_files(cluster) -> list[KeyFile]:
    return [KeyFile(t.labels["server"], t.host, t.key_file,
                    f"{d.monitoring_keys_dir}/{t.labels['server']}")
            for t in targets(cluster) if t.kind == "llama-server" and t.key_file]


def config(cluster, interval: int = d.monitoring_scrape_interval,
           blackbox: str = d.monitoring_blackbox_address) -> dict:
    """prometheus.yml: global intervals, the rule file, one scrape job per llama-server, one for
    the rpc-servers and one for their hosts (both through the blackbox exporter at `blackbox`)."""
    jobs: list[dict] = []
    keys = {k.server: k.path for k in key_files(cluster)}
    by_job: dict[str, dict] = {}
    for t in targets(cluster):
        static = {"targets": [t.address], "labels": {"job": d.monitoring_jobs[t.kind], **t.labels}}
        if t.kind == "llama-server":
            job = {"job_name": t.job_name, "metrics_path": "/metrics",
                   "static_configs": [static]}
            if t.labels["server"] in keys:
                job["authorization"] = {"type": "Bearer",
                                        "credentials_file": keys[t.labels["server"]]}
            jobs.append(job)
            continue
        job = by_job.get(t.job_name)
        if job is None:
            job = by_job[t.job_name] = {
                "job_name": t.job_name, "metrics_path": "/probe",
                "params": {"module": [d.monitoring_probe_module]},
                # The probe's own timeout must fit in the scrape's (blackbox takes the smaller,
                # less half a second).
                "scrape_timeout": f"{min(interval, d.monitoring_probe_timeout + 3)}s",
                "static_configs": [],
                "relabel_configs": [
                    {"source_labels": ["__address__"], "target_label": "__param_target"},
                    {"source_labels": ["__param_target"], "target_label": "instance"},
                    {"target_label": "__address__", "replacement": blackbox},
                ]}
            jobs.append(job)
        job["static_configs"].append(static)
    return {"global": {"scrape_interval": f"{interval}s", "evaluation_interval": f"{interval}s"},
            "rule_files": [d.monitoring_files["rules"]],
            "scrape_configs": jobs}


def blackbox_config() -> dict:
    """blackbox.yml: the TCP connect module the rpc-server and host probes use."""
    return {"modules": {d.monitoring_probe_module: {
        "prober": "tcp", "timeout": f"{d.monitoring_probe_timeout}s"}}}


def rules() -> dict:
    """meshdeploy.rules.yml: tokens/s per server and workers up (see the module's docstring)."""
    jobs = d.monitoring_jobs
    w = d.monitoring_rate_window
    server = f'{{job="{jobs["llama-server"]}"}}'
    by = "cluster, host, server"
    rpc = f'{{job="{jobs["rpc-server"]}"}}'
    host = f'{{job="{jobs["host"]}"}}'
    # A probe that took at least half its timeout met a dropped SYN, not a refusal.
    half = d.monitoring_probe_timeout / 2
    up = (f"clamp_max(probe_success{rpc} + on (cluster, host, port) "
          f"(probe_duration_seconds{rpc} >= bool {half:g}) * on (cluster, host) group_left () "
          f"probe_success{host}, 1)")
    return {"groups": [{"name": "meshdeploy", "rules": [
        # llama.cpp's counters move when a completion ends (its slot is released).
        {"record": f"meshdeploy:generated_tokens:rate{w}",
         "expr": f"sum by ({by}) (rate(llamacpp:tokens_predicted_total{server}[{w}]))"},
        {"record": f"meshdeploy:generation_tokens_per_second:{w}",
         "expr": f"sum by ({by}) (rate(llamacpp:tokens_predicted_total{server}[{w}])) / "
                 f"sum by ({by}) (rate(llamacpp:tokens_predicted_seconds_total{server}[{w}]) > 0)"},
        {"record": "meshdeploy:rpc_server_up", "expr": up},
        {"record": "meshdeploy:workers_up", "expr": "sum by (cluster) (meshdeploy:rpc_server_up)"},
        {"record": "meshdeploy:workers", "expr": "count by (cluster) (meshdeploy:rpc_server_up)"},
    ]}]}


HEADER = ("# Generated by `meshdeploy prometheus` for cluster {cluster}: run it again "
          "after the file changes.\n")


def documents(cluster, interval: int = d.monitoring_scrape_interval,
              blackbox: str = d.monitoring_blackbox_address) -> dict[str, str]:
    """File name -> YAML text of prometheus.yml, blackbox.yml and the rule file, dumped by
    ruamel.yaml: every value from the cluster file is quoted by the YAML library."""
    data = {d.monitoring_files["prometheus"]: config(cluster, interval, blackbox),
            d.monitoring_files["blackbox"]: blackbox_config(),
            d.monitoring_files["rules"]: rules()}
    header = HEADER.format(cluster=cluster.name)
    return {name: header + dump(value) for name, value in data.items()}


def dump(value) -> str:
    from io import StringIO

    from ruamel.yaml import YAML

    yaml = YAML(typ="rt")
    yaml.default_flow_style = False
    yaml.width = 4096  # a PromQL expression stays on one line
    out = StringIO()
    yaml.dump(value, out)
    return out.getvalue()
