# Read (and with FOLLOW then follow) one host's service logs (commands/logs.py): journald's JSON
# lines on Linux, the launchd log files on macOS, each unit's after a "@unit <name>" line. On a
# rootless host MANAGER says whose: systemd-user reads the user's journal (journalctl --user),
# runit tails svlogd's `current` files (passed where launchd's log files are).
# Inputs: LINES, SINCE, FOLLOW (empty or 1), MANAGER; "$@" = unit, log file, unit, file, ...
# Every value arrives as a variable or a positional parameter, never as shell text.
if [ -n "$FOLLOW" ]; then
    exec 3<&0
    { cat <&3 >/dev/null 2>&1; kill 0; } >/dev/null 2>&1 &
fi
if [ "$MANAGER" = runit ] || [ "$(uname -s)" = Darwin ]; then
    if [ "$MANAGER" = runit ]; then printf '@runit\n'; else printf '@launchd\n'; fi
    # svlogd's lines carry their time: with --since and no -n, all of them (meshdeploy keeps
    # those since then); launchd's carry none, so their last lines.
    n=${LINES:-10}
    if [ "$MANAGER" = runit ] && [ -n "$SINCE" ] && [ -z "$LINES" ]; then n=+1; fi
    unit=
    for a; do
        if [ -z "$unit" ]; then unit=$a; continue; fi
        printf '@unit %s\n' "$unit"
        tail -n "$n" "$a" 2>/dev/null
        unit=
    done
    [ -n "$FOLLOW" ] || exit 0
    printf '@follow\n'
    n=$#; unit=
    for a; do if [ -z "$unit" ]; then unit=$a; else set -- "$@" "$a"; unit=; fi; done
    shift "$n"
    exec tail -F -n 0 "$@"
fi
user=
[ "$MANAGER" = systemd-user ] && user=--user
start=$(date '+%Y-%m-%d %H:%M:%S')
unit=
for a; do
    if [ -n "$unit" ]; then unit=; continue; fi
    unit=$a
    printf '@unit %s\n' "$unit"
    journalctl $user --no-pager -o json -u "$unit" ${LINES:+-n "$LINES"} \
        ${SINCE:+--since "$SINCE"} || exit
done
[ -n "$FOLLOW" ] || exit 0
printf '@follow\n'
n=$#; unit=
for a; do if [ -z "$unit" ]; then unit=$a; set -- "$@" -u "$a"; else unit=; fi; done
shift "$n"
exec journalctl $user --no-pager -o json -f -n all --since "$start" "$@"
