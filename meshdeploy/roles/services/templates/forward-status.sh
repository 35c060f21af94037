# meshdeploy status: one line per ssh forward of this orchestrator, as its login user:
# `forward WORKER STATE LISTENING/PORTS`. STATE is the unit's as its manager says it (MANAGER:
# "" for systemd, systemd-user, runit; runit's service folder under SVDIR_MD); a port counts
# when the kernel's socket table has a listener on it (ssh's own, on loopback), read from
# /proc/net/tcp or ss; LISTENING is `?` where neither can be read. Never a connect: ssh would
# carry it to the worker's rpc-server, whose one-place listen backlog a reconnecting
# llama-server needs (a closed probe stays queued there until rpc-server accepts it).
# Inputs: MANAGER, SVDIR_MD; positional: WORKER UNIT PORTS (comma-separated), per forward.
state_of() {
  case $MANAGER in
    systemd-user) systemctl --user is-active "$1" 2>/dev/null ;;
    runit)
      case "$(sv status "$SVDIR_MD/$1" 2>/dev/null)" in
        run:*) echo active ;; down:*) echo inactive ;; fail:*) echo failed ;; *) echo unknown ;;
      esac ;;
    *) systemctl is-active "$1" 2>/dev/null ;;
  esac
}
# listens PORT: 0 when a TCP socket listens on PORT, 1 when none does, 2 when no table is
# readable. /proc/net/tcp: field 2 ADDRESS:PORT (hex), field 4 the state (0A: LISTEN).
listens() {
  hex=$(printf '%04X' "$1")
  if [ -r /proc/net/tcp ]; then
    set -- /proc/net/tcp
    [ -r /proc/net/tcp6 ] && set -- "$@" /proc/net/tcp6
    awk -v p=":$hex" '$4 == "0A" && substr($2, length($2) - 4) == p { found = 1 }
                      END { exit !found }' "$@"
    return
  fi
  command -v ss >/dev/null 2>&1 || return 2
  out=$(ss -Hltn "sport = :$1" 2>/dev/null) || return 2
  [ -n "$out" ]
}
while [ "$#" -ge 3 ]; do
  worker=$1 unit=$2 ports=$3
  shift 3
  state=$(state_of "$unit")
  open=0 total=0
  for port in $(echo "$ports" | tr ',' ' '); do
    total=$((total + 1))
    listens "$port"
    case $? in
      0) [ "$open" = '?' ] || open=$((open + 1)) ;;
      2) open='?' ;;
    esac
  done
  printf 'forward %s %s %s/%s\n' "$worker" "${state:-unknown}" "$open" "$total"
done
