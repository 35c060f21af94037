# Remove a runit service folder: moved to a dot-name first (runsvdir ignores those, so it cannot
# start the service again), then stopped (sv down), its runsv told to exit for the service and
# its log service (sv exit), and deleted with its svlogd folder. Nothing when it is absent.
# Inputs: DIR (the service folder), GONE (its dot-name beside it), LOGS (svlogd's folder).
rm -rf "$LOGS"
[ -d "$DIR" ] || exit 0
rm -rf "$GONE"
mv "$DIR" "$GONE"
sv down "$GONE" >/dev/null 2>&1
sv exit "$GONE/log" >/dev/null 2>&1
sv exit "$GONE" >/dev/null 2>&1
# runsv ends the service, then the log service, then itself: wait for it (at most 10 s).
i=0
while sv status "$GONE" >/dev/null 2>&1 && [ "$i" -lt 10 ]; do i=$((i + 1)); sleep 1; done
rm -rf "$GONE"
