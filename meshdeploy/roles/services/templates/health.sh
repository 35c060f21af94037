# Wait for llama-server's /health to answer 200 (503 while it loads the model); each attempt
# reports itself (md_progress, core/progress.py). Inputs: RETRIES, INTERVAL (seconds between
# attempts), URL, UNIT, BUDGET (seconds, for the message). Falls through when it never did.
for i in $(seq "$RETRIES"); do c=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$URL"); [ "$c" = 200 ] && exit 0; md_progress health "$i" "$RETRIES" "${c:-0}" "$UNIT"; sleep "$INTERVAL"; done
echo "$UNIT: /health not 200 after $BUDGET s (last: $c)" >&2
