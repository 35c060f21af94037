# meshdeploy status: one line per ssh forward of this orchestrator, as its login user:
# `forward WORKER STATE ACCEPTING/PORTS`. STATE is the unit's as its manager says it (MANAGER:
# "" for systemd, systemd-user, runit; runit's service folder under SVDIR_MD); a port accepts
# when a TCP connect to 127.0.0.1:PORT succeeds within 2 s (ssh's own listener).
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
while [ "$#" -ge 3 ]; do
  worker=$1 unit=$2 ports=$3
  shift 3
  state=$(state_of "$unit")
  open=0 total=0
  for port in $(echo "$ports" | tr ',' ' '); do
    total=$((total + 1))
    # shellcheck disable=SC2016 # $0 is bash's, the port given after the script
    if timeout 2 bash -c ': </dev/tcp/127.0.0.1/$0' "$port" 2>/dev/null; then
      open=$((open + 1))
    fi
  done
  printf 'forward %s %s %s/%s\n' "$worker" "${state:-unknown}" "$open" "$total"
done
