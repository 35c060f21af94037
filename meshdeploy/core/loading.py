"""Load a cluster file as every command reads it: the config layer's schema and typed model, each
role's part (registry.file_hooks: what its section decides for the other layers, then its own
checks) and the config layer's checks, every problem at file:line:col in one ConfigError, in
file order; and the risks of the file alone (warnings)."""

from __future__ import annotations

from pathlib import Path

from meshdeploy.config import checks as config_checks
from meshdeploy.config.load import read_cluster
from meshdeploy.config.model import Cluster
from meshdeploy.core import registry
from meshdeploy.errors import ConfigError


def load_cluster(path: str | Path) -> Cluster:
    """Read, validate and resolve a cluster file; raises ConfigError listing every problem."""
    doc, cluster = read_cluster(path)
    cluster = registry.completed(cluster)
    issues = config_checks.check(doc, cluster) + registry.validations(doc, cluster)
    if issues:
        raise ConfigError(sorted(issues, key=lambda i: (i.line, i.col)))
    return cluster


def warnings(cluster: Cluster) -> list[str]:
    """The risks of the file alone, said at every validate, plan and apply: the config layer's
    (exposed rpc-servers, servers without a key or an allow list) and the roles' own."""
    return config_checks.warnings_for(cluster) + registry.file_warnings(cluster)
