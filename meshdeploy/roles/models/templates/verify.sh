# Hash a model file once and, on a match, leave a marker "<size> <mtime> <sha>" that later plans
# trust. Inputs: F (the file), SHA (its sha256), MARKER (the marker file); md_sha256 comes from the
# prelude (core.shell.SHA256). Runs under set -e:
# verify_script puts it first, download_script after download.sh.
H=$(md_sha256 "$F")
if [ "$H" != "$SHA" ]; then echo "$F: sha256 $H, expected $SHA" >&2; exit 1; fi
S=$(stat -Lc '%s %Y' "$F" 2>/dev/null || stat -Lf '%z %m' "$F")
echo "$S $SHA" > "$MARKER.tmp" && mv -f "$MARKER.tmp" "$MARKER"
