"""Defaults of the services role (see README.md)."""

# --- systemd ----------------------------------------------------------------------------------
services_unit_dir = "/etc/systemd/system"
services_unit_prefix = "meshdeploy-"
# The units this role owns (and removes when the file no longer names them): other roles'
# meshdeploy-* units (network's meshdeploy-nftables) are theirs.
services_unit_kinds = ("rpc-", "server-", "ssh-")
# GPU device nodes that are group-owned (ROCm's /dev/kfd, render nodes) need these groups.
services_gpu_groups = {"rocm": "render video", "vulkan": "render video"}
# DevicePolicy=closed leaves only /dev/null, zero, full, random, urandom, tty and ptmx; each
# backend names the device groups (/proc/devices names, systemd.resource-control DeviceAllow=)
# it opens. A backend missing here gets PrivateDevices=yes (no device nodes at all).
services_device_allow = {
    # /dev/nvidia0..N and /dev/nvidiactl share the "nvidia-frontend" major; the CUDA runtime
    # maps memory through /dev/nvidia-uvm(-tools); /dev/nvidia-caps/* gate MIG instances.
    "cuda": ("char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps r"),
    # Vulkan opens render nodes /dev/dri/renderD* (and card* for some drivers).
    "vulkan": ("char-drm rw",),
    # ROCm: the compute queue device /dev/kfd plus the render nodes.
    "rocm": ("char-kfd rw", "char-drm rw"),
}
# CPU ggml generates no code at run time; GPU drivers do (CUDA JIT-compiles PTX, Mesa's
# llvmpipe/lavapipe and ROCm's comgr too), so W^X memory is denied only for these backends.
services_deny_write_execute = ("cpu",)

# --- launchd (macOS) ----------------------------------------------------------------------------
services_launchd_dir = "/Library/LaunchDaemons"
services_launchd_prefix = "com.meshdeploy."
services_launchd_log_dir = "/var/log/meshdeploy"

# --- rootless hosts (systemd --user, runit) -------------------------------------------------------
services_runit_log_dir = "log"        # svlogd's folders: <Layout.cache>/log/<unit>
services_runit_wait_seconds = 15      # runsvdir picks a new service folder up within 5 s

# --- readiness ------------------------------------------------------------------------------------
services_rpc_probe_seconds = 30       # rpc-server must accept TCP within this after a (re)start
services_journal_lines = 20           # journal lines shown when a service fails
services_health_exits = 5             # llama-server exits that end the /health wait early

# --- failover (md-failover runs a llama-server that may lose workers) -----------------------------
services_failover_script = "md-failover"     # {llama_cpp.prefix}/tools/md-failover-<sha12>.py
services_failover_python = "/usr/bin/python3"  # systemd units name their program by absolute path
services_failover_launchd_python = "/usr/bin/python3"  # macOS: the Command Line Tools' python3
services_failover_syscall = "pidfd_getfd"    # how it takes llama-server's connections to watch
