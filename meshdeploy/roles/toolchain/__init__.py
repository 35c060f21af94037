"""toolchain: build tools (cmake, compiler, git, curl, ninja, ccache), or what a host that copies
its llama.cpp build needs, and the apt proxy.

The role's declaration is role.py (ROLE); this package imports nothing, so that loading a
cluster file reads the role's settings and checks without its operations."""
