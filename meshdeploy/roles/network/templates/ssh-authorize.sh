# The login user's ~/.ssh/authorized_keys with this cluster's lines replaced by LINES (empty:
# removed), every other line kept byte for byte. Run as the login user, never through sudo: it
# is the user's own file. The new file is written to a fresh temporary name in ~/.ssh (mktemp:
# never an existing name or a link) and renamed over the old one, so sshd never reads half a
# file. Refused (the file left as it is): a link at authorized_keys (a rename would replace it,
# see the role's README), something that is not a regular file (a fifo, a folder), and a file
# another user owns (root's file in a folder the user can write: the rename would swap it for
# one the user owns). The read-modify-rename holds a lock on ~/.ssh (flock where util-linux has
# it, else a mkdir lock with a bounded wait), so a second meshdeploy writer (another cluster's
# apply) waits instead of losing this one's lines; the temporary file must hold exactly the kept
# lines plus LINES before it replaces the old one (awk's exit status may hide a short write).
# Inputs: MARKER ("meshdeploy-rpc:<cluster>:", the comment prefix of this cluster's lines),
# LINES (the wanted lines, one per line).
umask 077
dir="$HOME/.ssh"
file="$dir/authorized_keys"
fail() { echo "meshdeploy: $*" >&2; exit 1; }
if [ -L "$file" ]; then
  fail "$file is a symbolic link; not written through it (make it a regular file)"
fi
if [ ! -e "$file" ] && [ -z "$LINES" ]; then exit 0; fi
if [ ! -d "$dir" ]; then mkdir "$dir" && chmod 700 "$dir" || exit 1; fi
lock="$dir/.authorized_keys.meshdeploy.lock"
tmp=
trap 'rm -f "$tmp"; [ -z "$mklock" ] || rmdir "$mklock"' EXIT
mklock=
if command -v flock >/dev/null 2>&1; then
  exec 9<"$dir" || exit 1
  flock -w 60 9 || fail "another writer holds the lock on $dir for 60 s; try again"
else
  n=0
  until mkdir "$lock" 2>/dev/null; do
    n=$((n + 1))
    [ "$n" -lt 60 ] || fail "$lock held for 60 s; if no other apply runs, remove it (rmdir)"
    sleep 1
  done
  mklock="$lock"
fi
if [ -L "$file" ]; then
  fail "$file is a symbolic link; not written through it (make it a regular file)"
fi
if [ -e "$file" ] && [ ! -f "$file" ]; then
  fail "$file is not a regular file; not replaced (make it one)"
fi
if [ -e "$file" ] && [ ! -O "$file" ]; then
  me=$(id -un)
  fail "$file is owned by another user, not $me; not replaced by one of $me's (chown it to $me, or remove it)"
fi
tmp=$(mktemp "$dir/.authorized_keys.meshdeploy.XXXXXX") || exit 1
kept=0
if [ -f "$file" ]; then
  kept=$(M="$MARKER" awk 'index($NF, ENVIRON["M"]) != 1 { n++ } END { print n + 0 }' "$file")
fi
wanted=0
if [ -n "$LINES" ]; then wanted=$(printf '%s\n' "$LINES" | wc -l); fi
{
  if [ -f "$file" ]; then M="$MARKER" awk 'index($NF, ENVIRON["M"]) != 1' "$file" || exit 1; fi
  if [ -n "$LINES" ]; then printf '%s\n' "$LINES"; fi
} > "$tmp" || exit 1
got=$(wc -l < "$tmp")
case "$kept$wanted$got" in *[!0-9\ ]*|'') fail "could not count the lines of $file; left as it was" ;; esac
if [ $((got)) -ne $((kept + wanted)) ]; then
  fail "the new $file would hold $((got)) lines, not $((kept + wanted)) (a short write?); left as it was"
fi
chmod 600 "$tmp" && mv -f "$tmp" "$file"
