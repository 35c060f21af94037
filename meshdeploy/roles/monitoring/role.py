"""monitoring: watching a cluster with Prometheus. No resource on the hosts: the role owns the
cluster file's `monitoring:` section (schema.json; the network role opens the services' ports to
its scrapers) and renders the scrape configuration that `meshdeploy prometheus` writes
(prometheus.py)."""

from meshdeploy.core.context import Teardown
from meshdeploy.core.registry import Role
from meshdeploy.roles.monitoring import prometheus

ROLE = Role(
    name="monitoring",
    doc=__doc__,
    facts=lambda req: [],
    resources=(),
    # Nothing of the role's is on a host: the scrapers' rules are the network role's table.
    destroy=lambda ctx, purge: Teardown(),
    admits=prometheus.scrapers,
)
