# stop_pid FILE (a prelude of md-share-start.sh and md-share-stop.sh; input: SERVER, md-share's
# path): the md-share whose pid file is FILE stopped, and FILE removed. A stale FILE may name
# any process by now: signal it only while it runs this md-share with that very pid file.
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
