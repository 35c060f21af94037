"""The monitoring role's part in loading a cluster file (registry.file_hooks): what JSON Schema
cannot say of monitoring.scrapers."""

from __future__ import annotations

import ipaddress

from meshdeploy.config.document import Document
from meshdeploy.config.addresses import PRIVATE_NETWORKS
from meshdeploy.config.model import Cluster
from meshdeploy.errors import ConfigIssue
from meshdeploy.roles.monitoring.prometheus import SECTION, scrapers


def validate(doc: Document, cluster: Cluster) -> list[ConfigIssue]:
    """monitoring.scrapers: addresses or networks, as nftables rules and IPAddressAllow= hold
    them (a DNS name there would leave a unit without its IP restriction)."""
    issues = []
    for i, value in enumerate(scrapers(cluster)):
        try:
            net = ipaddress.ip_network(value, strict=True)
        except ValueError:
            issues.append(doc.issue((SECTION, "scrapers", i),
                                    f"{value!r} is not an IP address or network",
                                    "write the address Prometheus scrapes from (10.0.0.5) or "
                                    "its network (10.0.0.0/24)"))
            continue
        # A scraper reaches the llama-servers' APIs and the rpc-servers' ports: beyond the
        # private ranges only as a public bind is, with network.allow_public.
        private = any(net.version == p.version and net.subnet_of(p) for p in PRIVATE_NETWORKS)
        if not private and not cluster.network.allow_public:
            issues.append(doc.issue((SECTION, "scrapers", i),
                                    f"{value!r} is not inside a private network: it would "
                                    "reach the servers' ports from beyond the LAN",
                                    "name the scraper's private address, or set "
                                    "network.allow_public: true to accept the risk"))
    return issues
