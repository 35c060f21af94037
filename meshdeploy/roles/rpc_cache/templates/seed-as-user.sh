# Run the seeding script SEED on a rootless host, as its login user: the rpc-server runs as that
# same user there (under the user's systemd --user or runit). Inputs (assigned above by
# rpc_cache.operations): CACHE (the rpc-server's LLAMA_CACHE folder, whose rpc/ seed.sh fills),
# SEED (seed.sh with its inputs and calls).
#
# No unit and no setpriv: there is no other uid to become, and a unit of the user's manager
# would add no folder or sandbox the rpc-server lacks. The seed stays in the step's process
# group (inflight.guarded's session): a stopped step (Ctrl-C twice, a dead run's lock taken
# over) ends it with md-rpc-seed and curl, as systemctl stop ends the seed unit on a host with
# root. The cache folder is the user's alone (0700, what systemd gives a DynamicUser's); a link
# or file where it belongs is removed, never followed, as seed.sh does at rpc/ and every entry.
umask 077
if [ -L "$CACHE" ] || { [ -e "$CACHE" ] && [ ! -d "$CACHE" ]; }; then
  echo "removed a link (or file) where the cache folder $CACHE belongs" >&2
  rm -f "$CACHE"
fi
mkdir -p "$CACHE" && chmod 0700 "$CACHE" || exit 1
exec sh -c "$SEED"
