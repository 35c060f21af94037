"""monitoring: the names and figures of the Prometheus configuration `meshdeploy prometheus`
renders (the role variables of roles/monitoring/README.md)."""

# Where Prometheus reaches the blackbox exporter that probes the rpc-servers (--blackbox).
monitoring_blackbox_address = "127.0.0.1:9115"
monitoring_scrape_interval = 15  # seconds (--interval)
# The blackbox module's connect timeout. A refused connect answers in a millisecond; one that
# takes the whole timeout met a dropped SYN (see prometheus.py: an rpc-server in use).
monitoring_probe_timeout = 2
monitoring_probe_module = "meshdeploy_tcp"
# The `job` label of each kind of target, whatever the scrape job's own (unique) name.
monitoring_jobs = {"llama-server": "meshdeploy-llama-server",
                   "rpc-server": "meshdeploy-rpc-server",
                   "host": "meshdeploy-host"}
# The files written into --out: Prometheus resolves relative paths (rule files, credentials
# files) against the directory of its configuration file.
monitoring_files = {"prometheus": "prometheus.yml", "blackbox": "blackbox.yml",
                    "rules": "meshdeploy.rules.yml"}
monitoring_keys_dir = "keys"  # credentials files: keys/<server name>
monitoring_rate_window = "5m"
