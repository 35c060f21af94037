# md_share_as_unit COMMAND...: md-share as the transient unit UNIT (a prelude of
# md-share-start.sh). md_share_unit (before it) is md_systemd_run with the unit's settings: the
# system manager's, or with --user the login user's on a rootless host, where the prelude also
# points systemctl and journalctl at that manager. An earlier unit of the name is stopped and
# unloaded first (md_unit_free), and again, at most twice, when systemd-run still finds the name
# taken (each time after md_unit_free's wait). Inputs: UNIT, LOG, HOST.
# shellcheck disable=SC2317 # alive and why are called by md-share-start.sh
md_share_as_unit() {
  n=0
  while :; do
    md_unit_free "$UNIT.service" || true  # still loaded: the start below is refused, and retried
    err=$(md_share_unit "$@" 2>&1) && break
    n=$((n + 1))
    case "$err" in *"already loaded"*) [ $n -ge 3 ] || continue ;; esac
    printf '%s\n' "$err" >&2
    echo "$HOST: md-share did not start (systemd-run)" >&2; exit 1
  done
  alive() { systemctl is-active --quiet "$UNIT.service"; }
  why() { tail -n 5 "$LOG"; journalctl -u "$UNIT.service" -n 5 --no-pager -o cat 2>/dev/null; }
}
