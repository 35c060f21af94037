# md-share stopped at the end of a run, while the run still holds the host lock (a prelude of
# the lock's release; engine/locks.py): it serves files only while an apply's steps fetch them,
# and would otherwise live until idle, its port open to the hosts it served. Inputs: UNIT,
# MANAGER (core.share.stop_script: "" on a host with root, else the rootless host's), BOOTED,
# PID, SERVER, LOCK and TOKEN (the host lock and this run's token: nothing is stopped once
# another run took the lock over). stop_pid comes from md-share-pid.sh.
if grep -qF "$TOKEN" "$LOCK/owner" 2>/dev/null; then
  case "$MANAGER" in
    runit) ;;
    systemd-user)
      export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/run/user/$(id -u)}"
      systemctl --user stop "$UNIT.service" 2>/dev/null
      systemctl --user reset-failed "$UNIT.service" 2>/dev/null ;;
    *)
      if [ -d "$BOOTED" ] && command -v systemctl >/dev/null 2>&1; then
        systemctl stop "$UNIT.service" 2>/dev/null
        systemctl reset-failed "$UNIT.service" 2>/dev/null
      fi ;;
  esac
  stop_pid "$PID"
fi
