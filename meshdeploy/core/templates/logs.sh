# Read (and with FOLLOW then follow) one host's service logs (commands/logs.py): journald's JSON
# lines on Linux, the launchd log files on macOS, each unit's after a "@unit <name>" line.
# Inputs: LINES, SINCE, FOLLOW (empty or 1); "$@" = unit, launchd log file, unit, file, ...
# Every value arrives as a variable or a positional parameter, never as shell text.
if [ -n "$FOLLOW" ]; then
    exec 3<&0
    { cat <&3 >/dev/null 2>&1; kill 0; } >/dev/null 2>&1 &
fi
if [ "$(uname -s)" = Darwin ]; then
    printf '@launchd\n'
    unit=
    for a; do
        if [ -z "$unit" ]; then unit=$a; continue; fi
        printf '@unit %s\n' "$unit"
        tail -n "${LINES:-10}" "$a" 2>/dev/null
        unit=
    done
    [ -n "$FOLLOW" ] || exit 0
    printf '@follow\n'
    n=$#; unit=
    for a; do if [ -z "$unit" ]; then unit=$a; else set -- "$@" "$a"; unit=; fi; done
    shift "$n"
    exec tail -F -n 0 "$@"
fi
start=$(date '+%Y-%m-%d %H:%M:%S')
unit=
for a; do
    if [ -n "$unit" ]; then unit=; continue; fi
    unit=$a
    printf '@unit %s\n' "$unit"
    journalctl --no-pager -o json -u "$unit" ${LINES:+-n "$LINES"} \
        ${SINCE:+--since "$SINCE"} || exit
done
[ -n "$FOLLOW" ] || exit 0
printf '@follow\n'
n=$#; unit=
for a; do if [ -z "$unit" ]; then unit=$a; set -- "$@" -u "$a"; else unit=; fi; done
shift "$n"
exec journalctl --no-pager -o json -f -n all --since "$start" "$@"
