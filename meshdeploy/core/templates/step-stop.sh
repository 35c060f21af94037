# End every guarded step still holding its lock (core/inflight.py): SIGTERM to its process
# group, SIGKILL after GRACE seconds. Inputs: DIR (the steps' folder), GRACE. Prints
# "stopped <session> <step>" for every step it ended.
[ -d "$DIR" ] && command -v flock >/dev/null 2>&1 || exit 0
for l in "$DIR"/*.lock; do
  [ -e "$l" ] || continue
  flock -n "$l" true && continue
  n=${l%.lock}; pg=$(head -n 1 "$n.pid" 2>/dev/null)
  case "$pg" in ''|*[!0-9]*) continue ;; esac
  kill -TERM "-$pg" 2>/dev/null; kill -CONT "-$pg" 2>/dev/null
  flock -w "$GRACE" "$l" true || { kill -KILL "-$pg" 2>/dev/null; flock -w 10 "$l" true; }
  echo "stopped $pg $(sed -n 2p "$n.pid" 2>/dev/null)"
done
true
