# A long step run guarded on its host (core/inflight.py): never beside another run of the
# same step, in a session of its own that step-stop.sh can end. Inputs: DIR (the steps'
# folder), NAME (the lock's file name), SLOT (the step's address), BODY (its script).
# <name>.pid gets the step's session id and address. fd 9 holds the lock; the step's processes
# inherit it, so the lock lives exactly as long as the step does. Hosts without flock or setsid
# (macOS) run the body unguarded.
if ! command -v flock >/dev/null 2>&1 || ! command -v setsid >/dev/null 2>&1 || \
   ! mkdir -p "$DIR" 2>/dev/null; then exec sh -c "$BODY"; fi
L="$DIR/$NAME"
exec 9>>"$L.lock"
if ! flock -n 9; then
  echo "$SLOT: waiting for the same step of an earlier run to end" >&2
  flock 9
fi
# shellcheck disable=SC2016 # $$ and $1..$3 are the inner sh's: its own pid and arguments
exec setsid -w sh -c 'printf "%s\\n%s\\n" $$ "$3" > "$1.pid"; exec sh -c "$2"' guard "$L" "$BODY" "$SLOT"
