"""network: each host's meshdeploy ports filtered to their peers (nftables `inet meshdeploy`),
the WireGuard tunnel between orchestrators and workers (network.transport: wireguard), and the
keys of the ssh forwards (network.transport: ssh).

The role's declaration is role.py (ROLE); this package imports nothing, so that loading a
cluster file reads the role's settings and checks without its operations."""
