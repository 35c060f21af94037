# (Re)start md-share, never as root. Inputs (assigned above by core.share.start_script): PY,
# SERVER (md-share.py), PID, OLD_PID, LOG, HOST, PORT, and what the prelude's functions read;
# md-share's arguments in "$@". md_share_launch (the prelude: md-share-launch.sh on a host with
# root, core.share's own lines on a rootless host) starts it and defines alive and why; stop_pid
# is md-share-pid.sh's. An md-share left by an earlier step or run is stopped first (it may
# serve other files).
# md-share writes PID once it listens; its output goes to LOG, so the SSH channel closes when
# this ends.
command -v "$PY" >/dev/null 2>&1 ||
  { echo "$HOST: no $PY to run md-share; the toolchain role installs it" >&2; exit 1; }
PY=$(command -v "$PY")
# held: the sockets on PORT that kept md-share from listening, if any (ss from iproute2).
held() {
  command -v ss >/dev/null 2>&1 || return 0
  s=$(ss -Htan "sport = :$PORT" 2>/dev/null) || return 0
  [ -z "$s" ] || printf 'port %s is held by:\n%s\n' "$PORT" "$s"
}
stop_pid "$OLD_PID"
mkdir -p "$(dirname "$LOG")"
md_share_launch "$PY" "$SERVER" --pid-file "$PID" "$@"
i=0
until [ -f "$PID" ]; do
  alive || { echo "$HOST: md-share did not start:" >&2; why >&2; held >&2; exit 1; }
  i=$((i + 1))
  [ $i -lt 100 ] || { echo "$HOST: md-share did not listen within 10 s" >&2; exit 1; }
  sleep 0.1
done
echo "md-share serving on port $PORT"
