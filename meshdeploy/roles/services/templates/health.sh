# Wait for llama-server's /health to answer 200 (503 while it loads the model); each attempt
# reports itself (md_progress, core/progress.py). Inputs: RETRIES, INTERVAL (seconds between
# attempts), URL, UNIT, BUDGET (seconds, for the message), EXITS. Falls through when it never
# did. Restart=always brings back a server that exits, but one that exits at once (a flag its
# build does not know, a missing file) would only do it again until the budget is spent: the
# wait ends once systemd has restarted it EXITS times (NRestarts counts since the unit loaded,
# so from what it was at the first poll). Hosts without systemctl wait the whole budget.
restarts() { n=$(systemctl show -p NRestarts --value "$UNIT" 2>/dev/null) || n=; case "$n" in '' | *[!0-9]*) n=0 ;; esac; echo "$n"; }
first=$(restarts); gone=0
for i in $(seq "$RETRIES"); do
  c=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$URL"); [ "$c" = 200 ] && exit 0
  md_progress health "$i" "$RETRIES" "${c:-0}" "$UNIT"
  gone=$(( $(restarts) - first )); [ "$gone" -ge "$EXITS" ] && break
  sleep "$INTERVAL"
done
if [ "$gone" -ge "$EXITS" ]; then
  echo "$UNIT: /health not 200 after $i of $RETRIES polls: it exited $gone times since its restart (last: $c)" >&2
else
  echo "$UNIT: /health not 200 after $BUDGET s (last: $c)" >&2
fi
