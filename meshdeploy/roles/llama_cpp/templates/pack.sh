# Pack an installed build into the tarball that the hosts copying it fetch from md-share, with
# its sha256 beside it. Inputs (assigned above by core.shell.template): BUILD (the installed
# build), ARCHIVE (the tarball's path); md_sha256 comes from the prelude (core.shell.SHA256).
# An archive is kept when the build's manifest is not newer than it and it is not newer than
# its sha256 (that sha256 is the one the copies are checked against); equal times count as not
# newer, as a file's time has the kernel's tick (a few ms) for its grain. One changed after its
# sha256 was written (the Builds fact reports none then), or older than a build installed
# again, is packed again.
set -e
[ -f "$BUILD/manifest" ] || { echo "no installed build at $BUILD to share" >&2; exit 1; }
if [ -f "$ARCHIVE.sha256" ] && [ -f "$ARCHIVE" ] &&
  [ -z "$(find "$BUILD/manifest" -newer "$ARCHIVE" 2>/dev/null)" ] &&
  [ -z "$(find "$ARCHIVE" -newer "$ARCHIVE.sha256" 2>/dev/null)" ]; then exit 0; fi
mkdir -p "${ARCHIVE%/*}"
rm -f "$ARCHIVE.tmp"
tar -C "$BUILD" -czf "$ARCHIVE.tmp" .
md_sha256 "$ARCHIVE.tmp" > "$ARCHIVE.sha256.tmp"
chmod 0644 "$ARCHIVE.tmp" "$ARCHIVE.sha256.tmp"
mv -f "$ARCHIVE.tmp" "$ARCHIVE" && mv -f "$ARCHIVE.sha256.tmp" "$ARCHIVE.sha256"
echo "packed $(wc -c < "$ARCHIVE" | tr -d ' ') bytes, sha256 $(cat "$ARCHIVE.sha256")"
