# What a run leaves in a rootless host's own folders once it releases the host lock, run while
# it still holds it (no other run acts on the host). Inputs: STEPS (the guarded steps' folder),
# PID (md-share's pid file), LOCK and TOKEN (the host lock and this run's token, as
# engine/locks.py's release), then "$@": meshdeploy's folders of the layout, children first.
# A finished step's lock and pid files: a step still running holds its lock, and stays.
for f in "$STEPS"/*.lock; do
  [ -e "$f" ] || continue
  flock -n "$f" rm -f "$f" "${f%.lock}.pid" 2>/dev/null || true
done
# md-share's pid file once its process is gone (it exits when idle).
if [ -f "$PID" ] && ! kill -0 "$(cat "$PID" 2>/dev/null)" 2>/dev/null; then rm -f "$PID"; fi
if grep -qF "$TOKEN" "$LOCK/owner" 2>/dev/null; then
  mv "$LOCK" "$LOCK.gone.$TOKEN" && rm -rf "$LOCK.gone.$TOKEN"
fi
# Folders left empty (after destroy --purge: all of them); rmdir leaves the others.
rmdir "$@" 2>/dev/null
true
