"""Defaults of the services role (see README.md)."""

# --- systemd ----------------------------------------------------------------------------------
services_unit_dir = "/etc/systemd/system"
services_unit_prefix = "meshdeploy-"
# GPU device nodes that are group-owned (ROCm's /dev/kfd, render nodes) need these groups.
services_gpu_groups = {"rocm": "render video", "vulkan": "render video"}

# --- launchd (macOS) ----------------------------------------------------------------------------
services_launchd_dir = "/Library/LaunchDaemons"
services_launchd_prefix = "com.meshdeploy."
services_launchd_log_dir = "/var/log/meshdeploy"

# --- readiness ------------------------------------------------------------------------------------
services_rpc_probe_seconds = 30       # rpc-server must accept TCP within this after a (re)start
services_journal_lines = 20           # journal lines shown when a service fails
