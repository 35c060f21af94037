"""services: rpc-server and llama-server units (systemd, launchd), restarted when they change.

The role's declaration is role.py (ROLE); this package imports nothing, so that loading a
cluster file reads the role's settings and checks without its operations."""
