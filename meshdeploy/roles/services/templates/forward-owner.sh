# After a (re)started forward's loopback ports accept: each listener is the forward's own, not
# another local user's that took the port while the forward was down (llama-server would send
# that process its tensors). ss -e names a socket's cgroup (a systemd unit's own) and its
# owner's uid (shown when not 0).
# Inputs: WHO (host/unit, for messages), MODE ("cgroup": WANT is "/UNIT.service", the end of the
# unit's cgroup; "uid": the login user's uid is wanted), WANT; positional: the ports.
if ! command -v ss >/dev/null 2>&1; then
  echo "$WHO: no ss (iproute2) here: who holds the forward's ports is not checked" >&2
  exit 0
fi
if [ "$MODE" = uid ]; then WANT=$(id -u); fi
for port do
  line=$(ss -Hltne "sport = :$port" 2>/dev/null | grep -F " 127.0.0.1:$port " | head -n 1)
  case $MODE in
    cgroup)
      held=$(printf '%s\n' "$line" | sed -n 's/.* cgroup:\([^ ]*\).*/\1/p')
      if [ -z "$held" ]; then
        echo "$WHO: ss names no cgroup for 127.0.0.1:$port: its holder is not checked" >&2
        continue
      fi
      case $held in
        *"$WANT") ;;
        *)
          echo "$WHO: 127.0.0.1:$port is held by cgroup $held, not by the forward: another" \
            "process took the port (llama-server would send it its tensors)" >&2
          exit 1 ;;
      esac ;;
    *)
      held=$(printf '%s\n' "$line" | sed -n 's/.* uid:\([0-9]*\).*/\1/p')
      if [ "${held:-0}" != "$WANT" ]; then
        echo "$WHO: 127.0.0.1:$port is held by uid ${held:-0}, not by the forward's user" \
          "($WANT): another user took the port (llama-server would send it its tensors)" >&2
        exit 1
      fi ;;
  esac
done
