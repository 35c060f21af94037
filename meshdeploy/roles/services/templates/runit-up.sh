# Start (or restart) a runit service folder and its log service once runsv supervises it
# (runsvdir looks for new folders every 5 s; before that `sv` cannot reach it), waiting (as
# systemctl restart does) until runsv reports it up.
# Inputs: DIR (the service folder), WAIT (seconds to wait for runsv), WHO (for the message).
rm -f "$DIR/down"
i=0
until sv status "$DIR" >/dev/null 2>&1; do
  i=$((i + 1))
  if [ "$i" -gt "$WAIT" ]; then
    echo "$WHO: no runsv supervises $DIR after $WAIT s: is runsvdir running over its folder?" >&2
    exit 1
  fi
  sleep 1
done
sv restart "$DIR/log" >/dev/null 2>&1 || true
sv -w "$WAIT" restart "$DIR" >/dev/null
