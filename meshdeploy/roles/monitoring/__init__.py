"""monitoring: watching a cluster with Prometheus. No resource on the hosts: the role owns the
cluster file's `monitoring:` section (schema.json; the network role opens the services' ports to
its scrapers) and renders the scrape configuration that `meshdeploy prometheus` writes
(prometheus.py).

The role's declaration is role.py (ROLE); this package imports nothing, so that loading a
cluster file reads the role's settings and checks without its operations."""
