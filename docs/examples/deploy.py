"""A pyinfra deploy that reuses two meshdeploy roles: the build toolchain and the rpc-server units.

    pyinfra inventory.py docs/examples/deploy.py --sudo -y --data meshdeploy_cluster=cluster.yaml

Name the inventory's hosts as the cluster file does. Each operation probes its host once and
plans from the cluster file exactly as `meshdeploy apply` would, so a worker that is already
converged reports no change, and one whose rpc-server was stopped by hand gets it started again.
Operations whose plan needs every host at once (rpc_cache.seed: the placement) refuse to run
here; `meshdeploy apply` runs them.
"""

from pyinfra import host

from meshdeploy.core.loading import load_cluster
from meshdeploy.operations import services, toolchain

CLUSTER = host.data.get("meshdeploy_cluster", "cluster.yaml")

toolchain.packages(cluster=CLUSTER)
for rpc in load_cluster(CLUSTER).host(host.name).rpc_servers:
    services.rpc_server(rpc.port, cluster=CLUSTER)
