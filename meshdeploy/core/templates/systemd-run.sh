# Shell functions for a script's prelude (loaded as core.shell.SYSTEMD_RUN; no inputs).
# md_unit_free UNIT: an earlier transient unit of that name stopped and unloaded (its name is
# free again only then), waiting at most 5 s.
# md_systemd_run OPTIONS... -- COMMAND ARGS... is systemd-run with every word after `--` written
# so that the unit runs exactly it. systemd expands "${VAR}" (and a whole-word "$VAR") in a
# unit's command line when it starts it, and reads "$$" as "$" (checked with systemd 252);
# specifiers are not expanded on a transient unit's command.
md_systemd_run() {
  n=$#; e=
  while [ "$n" -gt 0 ]; do
    a=$1; shift; n=$((n - 1))
    if [ -n "$e" ]; then a=$(printf '%s.' "$a" | sed 's/\$/$$/g'); a=${a%.}; fi
    [ "$a" = -- ] && e=1
    set -- "$@" "$a"
  done
  systemd-run "$@"
}
md_unit_free() {
  systemctl stop "$1" 2>/dev/null; systemctl reset-failed "$1" 2>/dev/null
  i=0
  while [ "$(systemctl show -p LoadState --value "$1" 2>/dev/null)" = loaded ] && [ $i -lt 50 ]; do
    sleep 0.1; i=$((i + 1))
  done
}
