# After a (re)started service's TCP ports accept: every listener on each port is the service's
# own, not another local user's that took the port while the service was down (a forward's
# squatter would be sent llama-server's tensors; rpc-server exits 0 when it cannot bind, and an
# rpc-server's squatter would be sent them through the forwards). ss -e names a socket's cgroup
# (a systemd unit's own) and its owner's uid (shown when not 0).
# Inputs: WHO (host/unit, for messages), WHAT (the service, for messages), MODE ("cgroup": WANT
# is the whole path of the unit's cgroup; "user": the unit UNIT of the login user's systemd
# --user manager, whose cgroup path that manager names; "uid": the login user's uid is
# wanted), WANT, UNIT; positional: the ports.
if ! command -v ss >/dev/null 2>&1; then
  if [ "$MODE" = uid ]; then
    echo "$WHO: no ss (iproute2) here: who holds $WHAT's ports is not checked" >&2
    exit 0
  fi
  echo "$WHO: no ss (iproute2) here to check that $WHAT holds its ports (install iproute2)" >&2
  exit 1
fi
case $MODE in
  uid) WANT=$(id -u) ;;
  user) WANT=$(systemctl --user show -p ControlGroup --value "$UNIT" 2>/dev/null) ;;
esac
# A unit between two starts has no cgroup: whatever listens then is not its own.
[ -n "$WANT" ] || WANT="$UNIT, not running"
for port do
  lines=$(ss -Hltne "sport = :$port" 2>/dev/null)
  if [ -z "$lines" ]; then
    echo "$WHO: nothing listens on port $port" >&2
    exit 1
  fi
  # Every listener on the port: one on 0.0.0.0 or another address would take connections too.
  while IFS= read -r line; do
    at=$(printf '%s\n' "$line" | awk '{ print $4 }')
    case $MODE in
      uid)
        held=$(printf '%s\n' "$line" | sed -n 's/.* uid:\([0-9]*\).*/\1/p')
        if [ "${held:-0}" != "$WANT" ]; then
          echo "$WHO: $at is held by uid ${held:-0}, not by $WHAT's user ($WANT): another" \
            "user took the port" >&2
          exit 1
        fi ;;
      *)
        held=$(printf '%s\n' "$line" | sed -n 's/.* cgroup:\([^ ]*\).*/\1/p')
        if [ -z "$held" ]; then
          echo "$WHO: ss names no cgroup for $at, so its holder cannot be checked (cgroup ids" \
            "need Linux 5.7 and iproute2 5.7 or later, and cgroup v2)" >&2
          exit 1
        fi
        if [ "$held" != "$WANT" ]; then
          echo "$WHO: $at is held by cgroup $held, not by $WHAT ($WANT): another process" \
            "took the port" >&2
          exit 1
        fi ;;
    esac
  done <<LINES
$lines
LINES
done
