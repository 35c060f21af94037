# Run the seeding script SEED as the rpc-server's own user. Inputs (assigned above by
# rpc_cache.operations): UNIT (the rpc-server's unit, whose DynamicUser has the same name),
# SEED (seed.sh with its inputs and calls), BOOTED (present when systemd is PID 1), RUNDIR (a
# folder root keeps for the script); "$@": the transient unit's settings (seed_properties: the
# same user and CacheDirectory, and a sandbox at least the rpc-server's). md_systemd_run is
# core.shell.SYSTEMD_RUN (systemd-run, the command written so systemd expands nothing in it).
#
# rpc-server is an unauthenticated network service and owns its cache folder: root never writes
# there. On systemd hosts the script runs in a transient unit with the same dynamic user and
# CacheDirectory, so systemd gives it the rpc-server's UID and the same view of the folder
# (/var/cache/private is root's alone outside the unit), and nothing more than the rpc-server
# has. Elsewhere (macOS, no systemd) it runs as is: seed.sh refuses a folder it does not own.
if [ -d "$BOOTED" ] && command -v systemd-run >/dev/null 2>&1; then
  U="$UNIT-seed"
  # The script goes in a file root keeps (a unit's command line cannot carry its newlines:
  # systemd writes them into the transient unit file). We hold this step's lock
  # (inflight.guarded): the name is ours, and a unit of that name is an earlier run's orphan.
  mkdir -p "$RUNDIR" && chmod 0755 "${RUNDIR%/*}" "$RUNDIR"
  F="$RUNDIR/$U.sh"
  printf '%s\n' "$SEED" > "$F.tmp" && chmod 0644 "$F.tmp" && mv -f "$F.tmp" "$F"
  md_unit_free "$U.service"
  set -- --quiet --wait --pipe --collect --unit="$U" --service-type=exec "$@"
  # A start that systemd gave up on before the script ran (its log of the unit says no
  # "Started") is tried once more: the seeding wrote nothing yet, and repeating it is safe.
  # Whatever else fails, the step says what systemd logged of the unit. On the lab a step
  # failed after 91 s twice; the second time systemd's log said "State 'stop-sigterm' timed
  # out": the script had exited with a progress watcher's sleep still in the unit's cgroup,
  # and systemd waited its 90 s for the cgroup to empty. md_unwatch now ends that sleep too.
  n=0
  while :; do
    T0=$(date +%s)
    md_systemd_run "$@" -- /bin/sh "$F" </dev/null &
    S=$!
    # A stopped step (Ctrl-C twice, a dead run's lock taken over) stops the unit with it.
    trap 'systemctl stop "$U" 2>/dev/null; wait "$S"; rm -f "$F"; exit 143' TERM INT HUP
    C=0
    wait "$S" || C=$?
    [ "$C" != 0 ] || break
    n=$((n + 1))
    log=$(journalctl -u "$U.service" --since "@$T0" -n 15 --no-pager -o cat 2>&1)
    if [ "$n" -lt 2 ] && ! printf '%s\n' "$log" | grep -q '^Started '; then
      echo "the seeding unit $U did not start (status $C); trying once more. systemd's log of it:" >&2
      printf '%s\n' "$log" | sed 's/^/  /' >&2
      md_unit_free "$U.service"
      continue
    fi
    echo "the seeding unit $U ended with status $C; systemd's log of it:" >&2
    printf '%s\n' "$log" | sed 's/^/  /' >&2
    break
  done
  rm -f "$F"
  exit "$C"
fi
exec /bin/sh -c "$SEED"
