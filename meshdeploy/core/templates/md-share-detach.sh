# md_share_detach COMMAND...: md-share as a background process in a session of its own (it
# outlives this script and the SSH session), its output appended to LOG (a prelude of
# md-share-start.sh). Input: LOG.
# shellcheck disable=SC2317 # alive and why are called by md-share-start.sh
md_share_detach() {
  if command -v setsid >/dev/null 2>&1; then set -- setsid "$@"; else set -- nohup "$@"; fi
  "$@" </dev/null >>"$LOG" 2>&1 &
  S=$!
  alive() { kill -0 "$S" 2>/dev/null; }
  why() { tail -n 5 "$LOG"; }
}
