# Fill one rpc-server cache folder. Inputs (assigned above by rpc_cache.operations): D (the cache
# folder), M (its marker), HEX16 (a glob of entry names); TOOL, ATTEMPTS, LANES when tensors are
# fetched. Below these functions the operation appends one seed_one/fetch_one call per model,
# each with its tensor list as a heredoc, then seed_finish.
#
# It runs as the rpc-server's own user (seed-as-service.sh; on a rootless host the login user,
# seed-as-user.sh), or as root where the folder is root's: it refuses a folder another user
# owns. Whatever else can write here is that same user, so nothing is written through a name
# that may already exist: work files live in a folder mktemp makes, the marker is renamed into
# place, entries are md-rpc-seed's (O_EXCL|O_NOFOLLOW temporaries renamed over whatever held the
# name), and a link where a folder or an entry belongs is removed, never followed.
set -e
P=${D%/*}
mkdir -p "$P"
me=$(id -u)
owner=$(stat -L -c %u "$P" 2>/dev/null || stat -L -f %u "$P")
if [ "$owner" != "$me" ]; then
  echo "$P belongs to uid $owner, not to uid $me that seeds it: refusing to write there" >&2
  exit 1
fi
if [ -L "$D" ] || { [ -e "$D" ] && [ ! -d "$D" ]; }; then
  echo "removed a link (or file) where the cache folder $D belongs" >&2
  rm -f "$D"
fi
mkdir -p "$D"
owner=$(stat -c %u "$D" 2>/dev/null || stat -f %u "$D")
if [ "$owner" != "$me" ]; then
  echo "$D belongs to uid $owner, not to uid $me that seeds it: refusing to write there" >&2
  exit 1
fi
# Leftovers of an interrupted run, and the work names of earlier releases ($HEX16 is a glob).
# shellcheck disable=SC2086
rm -rf "$D"/.meshdeploy-work.* "$D"/.$HEX16.tmp "$M.tmp" "$D/.meshdeploy-seed-list" \
  "$D/.meshdeploy-seed-list".*
W=$(mktemp -d "$D/.meshdeploy-work.XXXXXX")
L="$W/list"
MT="$W/marker"
: > "$MT"

seed_progress() {
  md_progress seed "$(awk '{ s += $2 } END { printf "%.0f", s }' "$L.out" 2>/dev/null || echo 0)" "$T" "$N"
}

# seed_one TOOL GGUF CONTENT_ID, "<offset> <size>" lines on stdin: md-rpc-seed hashes each tensor
# of the local GGUF and writes the entries it lacks.
seed_one() {
  [ ! -e "$2" ] || [ -r "$2" ] || { echo "$2: uid $me, which seeds the cache as the rpc-server's user, cannot read it; make it readable by all (mode 0644, folders 0755)" >&2; exit 1; }
  cat > "$L"
  # Live progress: the bytes of the tensors md-rpc-seed answered for so far, every 2 s.
  T=$(awk '{ s += $2 } END { printf "%.0f", s }' "$L"); N=${2##*/}; : > "$L.out"
  md_watch seed_progress; C=0
  "$1" "$2" "$D" < "$L" > "$L.out" || C=$?
  md_unwatch; [ "$C" = 0 ] || exit "$C"
  # md-rpc-seed answers line by line, in order: pair each answer with its request.
  [ "$(wc -l < "$L")" = "$(wc -l < "$L.out")" ] || \
    { echo "md-rpc-seed answered for fewer tensors than asked" >&2; exit 1; }
  paste -d ' ' "$L" "$L.out" | awk -v s="$3" '$2 != $4 { exit 1 } { print s, $1, $2, $3 }' >> "$MT" || \
    { echo "md-rpc-seed answers do not match the tensor list" >&2; exit 1; }
}

# fetch_one URL CONTENT_ID NAME, "<offset> <size> <16hex> <sha256>" lines on stdin: each tensor a
# ranged GET piped into md-rpc-seed --receive, which puts the entry in place only when its size,
# FNV-1a and sha256 are the digest list's (made from the verified file). Up to $LANES lanes (one
# per core) fetch and hash at once; a tensor's lane is picked by its name, so two equal tensors
# never write one temporary file side by side.
fetch_one() {
  cat > "$L"
  T=$(awk '{ s += $2 } END { printf "%.0f", s }' "$L"); N=$3; : > "$L.out"
  P=$(nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1)
  # shellcheck disable=SC2153 # LANES is an input
  [ "$P" -le "$LANES" ] 2>/dev/null || P=$LANES
  md_watch seed_progress; i=0; lanes=
  while [ "$i" -lt "$P" ]; do
    awk -v n="$P" -v i="$i" '(index("0123456789abcdef", substr($3, 16, 1)) - 1) % n == i' "$L" > "$L.$i"
    fetch_lane "$1" "$2" < "$L.$i" > "$L.$i.m" & lanes="$lanes $!"; i=$((i + 1))
  done
  C=0; for w in $lanes; do wait "$w" || C=1; done
  md_unwatch; [ "$C" = 0 ] || exit 1
  i=0; while [ "$i" -lt "$P" ]; do cat "$L.$i.m" >> "$MT"; i=$((i + 1)); done
}

# One lane: its tensors in order, a marker line for each on stdout. A retry is a fresh GET: curl
# cannot take back bytes it already wrote to the pipe. An entry is kept only when it is a regular
# file of the right size, not a link to one.
fetch_lane() {
  while read -r o s f h; do
    if [ ! -L "$D/$f" ] && [ -f "$D/$f" ] && \
       [ "$(stat -c %s "$D/$f" 2>/dev/null || stat -f %z "$D/$f" 2>/dev/null)" = "$s" ]; then
      echo "$f $s kept" >> "$L.out"
    else
      a=1
      until curl -q -fsS --connect-timeout 10 -r "$o-$((o + s - 1))" "$1" | \
            "$TOOL" --receive "$D" "$s" "$f" "$h" >> "$L.out"; do
        [ "$a" -lt "$ATTEMPTS" ] || \
          { echo "$N: tensor at $o ($s bytes) not fetched from $1 after $a attempts" >&2; exit 1; }
        a=$((a + 1)); sleep 2
      done
    fi
    echo "$2 $o $s $f"
  done
}

# The marker first (renamed over whatever held its name), then every entry it does not name goes.
seed_finish() {
  if [ -L "$M" ] || [ -d "$M" ]; then rm -rf "$M"; fi
  mv -f "$MT" "$M"
  for f in "$D"/$HEX16; do
    [ -e "$f" ] || [ -L "$f" ] || continue
    grep -q " ${f##*/}\$" "$M" || rm -f "$f"
  done
  rm -rf "$W"
}
