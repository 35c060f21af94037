"""monitoring: no facts. The role reads nothing from the hosts: its files are rendered from the
cluster file alone (prometheus.py), and Prometheus itself asks the services."""
