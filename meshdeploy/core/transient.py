"""Transient systemd units meshdeploy starts on a host for a step (md-share; a cache's seeding
as its rpc-server's user): the sandbox they share, and how a host tells it runs systemd.

Their starting scripts use core.shell.SYSTEMD_RUN: md_systemd_run (systemd-run with the
command written so that systemd expands nothing in it) and md_unit_free (an earlier unit of the
name stopped and unloaded, so the name can be taken again).
"""

BOOTED = "/run/systemd/system"  # present when systemd is PID 1 (sd_booted)

# Settings every such unit gets (systemd-run -p), with its own user, folders and network rules;
# each unit's full list is scored by tests/unit/test_unit_hardening.py.
SANDBOX = (
    "ProtectSystem=strict", "ProtectHome=read-only", "PrivateTmp=yes", "PrivateDevices=yes",
    "NoNewPrivileges=yes", "UMask=0077", "ProtectKernelTunables=yes", "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes", "ProtectControlGroups=yes", "ProtectClock=yes",
    "ProtectHostname=yes", "ProtectProc=invisible",
    "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX", "RestrictNamespaces=yes",
    "RestrictRealtime=yes", "RestrictSUIDSGID=yes", "LockPersonality=yes",
    "MemoryDenyWriteExecute=yes", "RemoveIPC=yes", "CapabilityBoundingSet=",
    "AmbientCapabilities=", "SystemCallArchitectures=native",
    "SystemCallFilter=@system-service", "SystemCallFilter=~@privileged",
    "SystemCallErrorNumber=EPERM",
)
