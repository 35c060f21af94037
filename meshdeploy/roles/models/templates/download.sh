# Download a model file with resume, check its size and sha256, rename it to F; verify.sh follows
# it (the marker). Inputs: F, P (the partial), SIZE, SHA, URL, AUTH (non-empty: the
# Authorization header arrives on standard input, read by curl -H @-), LAN (non-empty: from
# another host's md-share), RETRIES, MARKER; md_progress, md_watch and md_unwatch come from the
# prelude (core/progress.py), md_sha256 too (core.shell.SHA256). Line by line:
# - An earlier run's download may have finished while this run was planning.
# - A partial longer than the file, or a finished one with the wrong bytes, starts over.
# - curl keeps the header in memory for its retries, and since 7.58 drops a custom
#   Authorization header on a redirect to another host (the Hub's CDN): the token goes to the
#   endpoint only.
# - From another host's md-share, which may start a moment after this step, a refused
#   connection is retried (not --retry-all-errors: a full disk must fail at once, with its
#   numbers).
# - Live progress: the partial's size every 2 s, and what was there before (R).
# - From md-share, a reply cut short (the source's step restarted md-share, or its own download
#   stalled) is resumed where it stopped, and a 404 or 503 (an earlier md-share that does not
#   serve this content yet, a partial not there yet) or a refused connection is asked again;
#   curl retries none of these by itself.
# - After a failed curl: how far it got and, when the disk is what stopped it, the numbers
#   (needed vs free). The partial stays for the next run to resume; only a whole file whose
#   sha256 matches is ever renamed to F.
set -e
mkdir -p "$(dirname "$F")"
[ -f "$F" ] && [ "$(cat "$MARKER" 2>/dev/null)" = "$(stat -Lc '%s %Y' "$F") $SHA" ] && { echo "$F: already downloaded and verified"; exit 0; }
S=$(stat -c %s "$P" 2>/dev/null || echo 0); [ "$S" -le "$SIZE" ] || rm -f "$P"
if [ -n "$AUTH" ]; then set -- -H @-; else set --; fi
[ -z "$LAN" ] || set -- "$@" --retry-connrefused
R=$(stat -c %s "$P" 2>/dev/null || echo 0)
download_progress() { md_progress download "$(stat -c %s "$P" 2>/dev/null || echo 0)" "$SIZE" "$R" "${F##*/}"; }
if [ "$R" -lt "$SIZE" ]; then md_watch download_progress; a=0
while :; do rc=0
  curl -fsSL --retry "$RETRIES" --retry-delay 2 -C - "$@" -o "$P" "$URL" || rc=$?
  if [ -n "$LAN" ] && [ "$a" -lt "$RETRIES" ] && { [ "$rc" = 18 ] || [ "$rc" = 52 ] || [ "$rc" = 56 ] || [ "$rc" = 22 ] || [ "$rc" = 7 ]; }; then a=$((a + 1)); sleep 2; else break; fi
done
md_unwatch; [ "$rc" = 0 ] || { S=$(stat -c %s "$P" 2>/dev/null || echo 0); FREE=$(df -Pk "$(dirname "$F")" | awk 'NR == 2 {printf "%.0f", $4 * 1024}'); NEED=$((SIZE - S)); if [ "$rc" = 23 ] || [ "${FREE:-0}" -lt "$NEED" ]; then echo "$F: the disk is full: needs $NEED more bytes ($((NEED >> 20)) MiB) of $SIZE, ${FREE:-0} bytes ($((${FREE:-0} >> 20)) MiB) free on $(dirname "$F"); $S bytes kept in $P to resume" >&2; else echo "$F: download failed at $S of $SIZE bytes (curl exit $rc); $P kept to resume" >&2; fi; exit "$rc"; }; fi
md_progress phase verify sha256
S=$(stat -c %s "$P"); [ "$S" = "$SIZE" ] || { echo "$F: downloaded $S bytes, expected $SIZE" >&2; exit 1; }
H=$(md_sha256 "$P"); [ "$H" = "$SHA" ] || { rm -f "$P"; echo "$F: sha256 $H, expected $SHA; partial removed" >&2; exit 1; }
mv -f "$P" "$F"
