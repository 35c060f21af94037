# The digest list of a shared model, made once from its sha256-verified file. Inputs (assigned
# above by rpc_cache.share): TOOL (md-rpc-seed), GGUF, OUT (the list), SHA (the GGUF's sha256);
# the operation appends `digest` with the "<offset> <size>" lines as a heredoc. A list with
# fewer lines than asked is never put in place.
set -e
digest() {
  cat > "$OUT.in"
  "$TOOL" --digest "$GGUF" < "$OUT.in" | awk -v s="$SHA" '{ print s, $0 }' > "$OUT.tmp"
  [ "$(wc -l < "$OUT.in")" = "$(wc -l < "$OUT.tmp")" ] || { echo "$GGUF: md-rpc-seed digested fewer tensors than asked" >&2; exit 1; }
  mv -f "$OUT.tmp" "$OUT"; rm -f "$OUT.in"
}
