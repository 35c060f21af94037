"""llama_cpp: one commit everywhere (lock file), the clone, and builds compiled once per build
key and copied to the key's other hosts (keys.py).

The role's declaration is role.py (ROLE); this package imports nothing, so that loading a
cluster file reads the role's settings and checks without its operations."""
