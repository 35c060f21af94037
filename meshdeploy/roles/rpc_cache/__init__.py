"""rpc_cache: rpc-server caches seeded with what each worker's placement holds.

The role's declaration is role.py (ROLE); this package imports nothing, so that loading a
cluster file reads the role's settings and checks without its operations."""
