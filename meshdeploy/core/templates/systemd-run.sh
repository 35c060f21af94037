# Shell functions for a script's prelude (loaded as core.shell.SYSTEMD_RUN; no inputs).
# md_unit_free UNIT: an earlier transient unit of that name stopped and unloaded, waiting at most
# 5 s (a unit that failed stays loaded until reset-failed, done again each second); returns 1
# when it is still loaded then. systemd-run refuses the name ("Unit ... was already loaded")
# until systemd has garbage-collected the old unit: a caller that must have the name tries again
# (md_share_as_unit). A 60-s wait that also killed the unit every 10 s was tried: on the lab it
# ran out in md-share's start and a seed unit's step failed after 91 s; the 5-s one never did.
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
  while [ "$(systemctl show -p LoadState --value "$1" 2>/dev/null)" = loaded ]; do
    [ $i -lt 50 ] || return 1
    sleep 0.1; i=$((i + 1))
    case $i in *0) systemctl reset-failed "$1" 2>/dev/null ;; esac
  done
}
