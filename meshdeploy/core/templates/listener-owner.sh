# md_owner UNIT ADDRESS PORT: whether every process listening where a connection to ADDRESS:PORT
# (TCP) can land belongs to the unit UNIT; asked before anything with an API key goes there
# (bench, status). A prelude: it defines functions only. Input: MANAGER, how UNIT is run: ""
# (a system unit: run as root, since ss -p names other users' processes only to root),
# "systemd-user" (systemctl --user: the login user's own processes) or "runit" (the service
# folder "$SVDIR_MD/UNIT": the listener is its process or a descendant of it).
# Prints two lines: "unit OWN" (the unit's cgroup, or "pid N" of a runit service; empty when it
# does not run), then one verdict: "owned", "none" (nothing listens there), "no-ss" (no ss to
# tell), "ss-failed" (ss could not list the sockets) or "foreign WHO": the first listener that is not the unit's, as its cgroup, "pid N"
# (runit) or "?" (ss names no process: another user's, unless run as root).

# md_cgroup PID: its cgroup ("0::" is the cgroup v2 line, "name=systemd" its v1 counterpart).
md_cgroup() {
  sed -n -e 's/^0::\(.*\)$/\1/p' -e 's/^[0-9]*:name=systemd:\(.*\)$/\1/p' \
    "/proc/$1/cgroup" 2>/dev/null | head -n 1
}

# md_under PID TOP: PID is TOP or one of its descendants.
md_under() {
  md_p=$1
  while [ -n "$md_p" ] && [ "$md_p" -gt 1 ] 2>/dev/null; do
    [ "$md_p" = "$2" ] && return 0
    md_p=$(sed -n 's/^PPid:[[:space:]]*//p' "/proc/$md_p/status" 2>/dev/null)
  done
  return 1
}

md_owner() {
  case $MANAGER in
    runit)
      if command -v sv >/dev/null 2>&1; then
        # "run: DIR: (pid N) 5s; run: log: (pid M) 5s": N, the service's own process.
        md_own=$(sv status "$SVDIR_MD/$1" 2>/dev/null)
        case $md_own in
          "run: $SVDIR_MD/$1: (pid "*) md_own=${md_own#"run: $SVDIR_MD/$1: (pid "}
                                      md_own=${md_own%%)*} ;;
          *) md_own= ;;
        esac
      else
        md_own=$(cat "$SVDIR_MD/$1/supervise/pid" 2>/dev/null)
      fi
      echo "unit ${md_own:+pid $md_own}" ;;
    systemd-user)
      md_own=$(systemctl --user show -p ControlGroup --value "$1" 2>/dev/null)
      echo "unit $md_own" ;;
    *)
      md_own=$(systemctl show -p ControlGroup --value "$1" 2>/dev/null)
      echo "unit $md_own" ;;
  esac
  command -v ss >/dev/null 2>&1 || { echo no-ss; return 0; }
  md_verdict=none
  # ss fails where it may not read the sockets (Android's SELinux denies apps sock_diag).
  md_listeners=$(ss -Hltnp "sport = :$3" 2>/dev/null) || { echo ss-failed; return 0; }
  while read -r _ _ _ md_local _ md_users; do
    [ -n "$md_local" ] || continue
    # 127.0.0.1:8080, [::ffff:127.0.0.1]:8080, 0.0.0.0%lo:8080, *:8080: the address alone.
    md_host=${md_local%:*}
    md_host=${md_host#\[}
    md_host=${md_host%\]}
    md_host=${md_host%%"%"*}
    case $md_host in
      "$2" | 0.0.0.0 | '*' | :: | "::ffff:$2") ;;
      *) continue ;;
    esac
    case $md_users in
      *pid=*) ;;
      *) echo "foreign ?"; return 0 ;;
    esac
    for md_pid in $(printf '%s\n' "$md_users" | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do
      if [ "$MANAGER" = runit ]; then
        if [ -z "$md_own" ] || ! md_under "$md_pid" "$md_own"; then
          echo "foreign pid $md_pid"; return 0
        fi
      else
        md_cg=$(md_cgroup "$md_pid")
        if [ -z "$md_own" ] || [ "$md_cg" != "$md_own" ]; then
          echo "foreign ${md_cg:-?}"; return 0
        fi
      fi
    done
    md_verdict=owned
  done <<EOF
$md_listeners
EOF
  echo "$md_verdict"
}
