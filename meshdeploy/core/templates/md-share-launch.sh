# md_share_launch COMMAND...: md-share started on a host with root (a prelude of
# md-share-start.sh, after md-share-unit.sh and md-share-detach.sh). Where systemd is PID 1
# (BOOTED exists) a transient unit with a dynamic user; elsewhere a process of nobody's, through
# setpriv where util-linux has it, else sudo -u, its pid file's folder made nobody's. Inputs:
# BOOTED, PID, HOST; stop_pid comes from md-share-start.sh.
md_share_launch() {
  if [ -d "$BOOTED" ] && command -v systemd-run >/dev/null 2>&1; then
    md_share_as_unit "$@"
    return
  fi
  stop_pid "$PID"
  D=$(dirname "$PID"); mkdir -p "$D" && chown nobody "$D" && chmod 755 "$D" || exit 1
  if command -v setpriv >/dev/null 2>&1; then
    set -- setpriv --reuid="$(id -u nobody)" --regid="$(id -g nobody)" --clear-groups \
      --no-new-privs "$@"
  elif command -v sudo >/dev/null 2>&1; then
    set -- sudo -n -u nobody "$@"
  else
    echo "$HOST: md-share runs as nobody through setpriv or sudo; this host has neither" >&2
    exit 1
  fi
  md_share_detach "$@"
}
