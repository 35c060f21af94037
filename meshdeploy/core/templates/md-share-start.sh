# (Re)start md-share, never as root. Inputs (assigned above by core.share.start_script): PY,
# SERVER (md-share.py), PID, OLD_PID, LOG, BOOTED, UNIT, HOST, PORT; md-share's arguments in
# "$@"; md_share_unit (the prelude) is systemd-run with the unit's settings. An md-share left
# by an earlier step or run is stopped first (it may serve other files). md-share writes PID
# once it listens; its output goes to LOG, so the SSH channel closes when this ends.
command -v "$PY" >/dev/null 2>&1 ||
  { echo "$HOST: no $PY to run md-share; the toolchain role installs it" >&2; exit 1; }
PY=$(command -v "$PY")
# stop_pid FILE: a stale FILE may name any process by now: signal it only while it runs this
# md-share with that very pid file.
stop_pid() {
  [ -f "$1" ] || return 0
  p=; read -r p <"$1" || true
  case "$p" in ''|*[!0-9]*) ;; *)
    case "$(ps -ww -o args= -p "$p" 2>/dev/null) " in *" $SERVER --pid-file $1 "*)
      kill "$p" 2>/dev/null; i=0
      while [ -f "$1" ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done ;;
    esac ;;
  esac
  rm -f "$1"
}
stop_pid "$OLD_PID"
mkdir -p "$(dirname "$LOG")"
if [ -d "$BOOTED" ] && command -v systemd-run >/dev/null 2>&1; then
  md_unit_free "$UNIT.service"
  md_share_unit "$PY" "$SERVER" --pid-file "$PID" "$@" ||
    { echo "$HOST: md-share did not start (systemd-run)" >&2; exit 1; }
  alive() { systemctl is-active --quiet "$UNIT.service"; }
  why() { tail -n 5 "$LOG"; journalctl -u "$UNIT.service" -n 5 --no-pager -o cat 2>/dev/null; }
else
  stop_pid "$PID"
  D=$(dirname "$PID"); mkdir -p "$D" && chown nobody "$D" && chmod 755 "$D" || exit 1
  if command -v setpriv >/dev/null 2>&1; then
    set -- setpriv --reuid="$(id -u nobody)" --regid="$(id -g nobody)" --clear-groups \
      --no-new-privs "$PY" "$SERVER" --pid-file "$PID" "$@"
  elif command -v sudo >/dev/null 2>&1; then
    set -- sudo -n -u nobody "$PY" "$SERVER" --pid-file "$PID" "$@"
  else
    echo "$HOST: md-share runs as nobody through setpriv or sudo; this host has neither" >&2
    exit 1
  fi
  if command -v setsid >/dev/null 2>&1; then set -- setsid "$@"; else set -- nohup "$@"; fi
  "$@" </dev/null >>"$LOG" 2>&1 &
  S=$!
  alive() { kill -0 "$S" 2>/dev/null; }
  why() { tail -n 5 "$LOG"; }
fi
i=0
until [ -f "$PID" ]; do
  alive || { echo "$HOST: md-share did not start:" >&2; why >&2; exit 1; }
  i=$((i + 1))
  [ $i -lt 100 ] || { echo "$HOST: md-share did not listen within 10 s" >&2; exit 1; }
  sleep 0.1
done
echo "md-share serving on port $PORT"
