# The login user's ~/.ssh/authorized_keys with this cluster's lines replaced by LINES (empty:
# removed), every other line kept byte for byte. Run as the login user, never through sudo: it
# is the user's own file. The new file is written to a fresh temporary name in ~/.ssh (mktemp:
# never an existing name or a link) and renamed over the old one, so sshd never reads half a
# file; a rename replaces a link rather than writing through it, and a link found at
# authorized_keys is refused instead (see the role's README: why not replaced).
# Inputs: MARKER ("meshdeploy-rpc:<cluster>:", the comment prefix of this cluster's lines),
# LINES (the wanted lines, one per line).
umask 077
dir="$HOME/.ssh"
file="$dir/authorized_keys"
if [ -L "$file" ]; then
  echo "meshdeploy: $file is a symbolic link; not written through it (make it a regular file)" >&2
  exit 1
fi
if [ ! -e "$file" ] && [ -z "$LINES" ]; then exit 0; fi
if [ ! -d "$dir" ]; then mkdir "$dir" && chmod 700 "$dir" || exit 1; fi
tmp=$(mktemp "$dir/.authorized_keys.meshdeploy.XXXXXX") || exit 1
trap 'rm -f "$tmp"' EXIT
{
  if [ -f "$file" ]; then M="$MARKER" awk 'index($NF, ENVIRON["M"]) != 1' "$file" || exit 1; fi
  if [ -n "$LINES" ]; then printf '%s\n' "$LINES"; fi
} > "$tmp" || exit 1
chmod 600 "$tmp" && mv -f "$tmp" "$file"
