# Take the host lock (engine/locks.py), as root. Inputs: DIR (the lock's parent), LOCK (the lock
# folder), OWNER (this run's owner line), TAKE, TOKEN (this run's). Prints "acquired", or
# "held <seconds since the heartbeat> <owner line>".
# TAKE non-empty: replace a lock whose owner line is exactly TAKE (the stale one just read).
# Several runs may take one stale lock over at once: `mkdir "$LOCK/taking"` lets one of them
# through (mkdir is atomic); it checks the owner line again (the folder may already be a newer
# lock: then it withdraws) and moves the lock aside in one rename before removing it, so no run
# sees a half-removed lock, and every run then competes for the plain `mkdir "$LOCK"`: one wins.
mkdir -p "$DIR" && chmod 755 "$DIR" || exit 1
if [ -n "$TAKE" ] && [ "$(cat "$LOCK/owner" 2>/dev/null)" = "$TAKE" ] \
        && mkdir "$LOCK/taking" 2>/dev/null; then
    if [ "$(cat "$LOCK/owner" 2>/dev/null)" = "$TAKE" ]; then
        mv "$LOCK" "$LOCK.gone.$TOKEN" && rm -rf "$LOCK.gone.$TOKEN"
    else
        rmdir "$LOCK/taking" 2>/dev/null
    fi
fi
if mkdir "$LOCK" 2>/dev/null; then printf '%s\n' "$OWNER" > "$LOCK/owner"; echo acquired; exit 0; fi
now=$(date +%s)
if stat -c %Y / >/dev/null 2>&1; then then=$(stat -c %Y "$LOCK/owner" 2>/dev/null)
else then=$(stat -f %m "$LOCK/owner" 2>/dev/null); fi
case $then in ""|*[!0-9]*) then=$now ;; esac
echo "held $((now - then)) $(cat "$LOCK/owner" 2>/dev/null)"
