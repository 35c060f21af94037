"""Transient systemd units meshdeploy starts on a host for a step (md-share; a cache's seeding
as its rpc-server's user): the sandbox they share, and how a host tells it runs systemd.

Their starting scripts use core.shell.SYSTEMD_RUN: md_systemd_run (systemd-run with the
command written so that systemd expands nothing in it) and md_unit_free (an earlier unit of the
name stopped and unloaded, so the name can be taken again).

A rootless host (config.model.Layout.rootless) has no system manager to ask and no other user
to run a step as: its steps run as the login user.
- md-share under systemd --user is a transient unit of the user's manager (`systemd-run
  --user`, USER_SCOPE) with USER_SANDBOX; under runit, which supervises services only, a
  background process of the user's with its pid file (core/share.py).
- A cache's seeding runs as the user with no unit at all (rpc_cache's seed-as-user.sh): the
  rpc-server is that user already, so a unit would add no uid, folder or sandbox of its own.
  It stays in the step's process group (core.inflight.guarded's session), which a stopped step
  ends with everything in it, as `systemctl stop` ends a unit.
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

# What a user manager enforces of SANDBOX without privilege: the settings made of prctl and
# seccomp filters. The others need a mount or UTS namespace, capabilities or cgroup BPF, which a
# user manager lacks (systemd before 253 drops them silently; from 253 it asks the kernel for a
# user namespace, which many hosts refuse, and the unit fails). IPAddressAllow= is one of them
# (systemd/systemd#12327): on such a host md-share's own allow-list is the only filter.
_UNPRIVILEGED = {"NoNewPrivileges", "UMask", "RestrictAddressFamilies", "RestrictNamespaces",
                 "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality",
                 "MemoryDenyWriteExecute", "SystemCallArchitectures", "SystemCallFilter",
                 "SystemCallErrorNumber"}
USER_SANDBOX = tuple(p for p in SANDBOX if p.split("=", 1)[0] in _UNPRIVILEGED)
# Prelude lines after core.shell.SYSTEMD_RUN on a systemd --user host: systemctl and journalctl
# (md_unit_free's too) ask the login user's manager, which an SSH session without pam_systemd
# finds only through XDG_RUNTIME_DIR.
USER_SCOPE = ('export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/run/user/$(id -u)}"\n'
              'systemctl() { command systemctl --user "$@"; }\n'
              'journalctl() { command journalctl --user "$@"; }')
