# network.transport: ssh: one orchestrator's forward to one worker. The master ssh runs in the
# background (forward only, -N, with a control socket); once its socket answers `-O check`, one
# session through it runs the key's forced command (it exits 1: the expected answer): OpenSSH
# before 10.1 sets TCP_NODELAY on sshd's end of a connection only when a session runs a command,
# and without it every small rpc-server reply waits for a delayed ACK (docs/benchmarks.md).
# Then it waits for the master and exits with its status; the supervisor starts it again.
# TERM and INT stop the master first.
# Where this host's md-share serves the worker model bytes, the reverse end (-R) is asked of the
# running master through its socket, again every 10 s until it holds and whenever it is lost,
# never on the master's command line: there ExitOnForwardFailure would take the RPC ports down
# with it whenever the worker's port is taken (a stale session of a dropped link keeps it until
# the worker's sshd notices, a local process may bind it, an sshd may refuse remote forwards).
# Inputs (positional): CTL (control socket), KEY, KNOWN (known_hosts), SSHPORT, USER, ADDR, then
# one -L value per forwarded port (127.0.0.1:LOCAL:127.0.0.1:PORT) and at most one
# R=127.0.0.1:PORT:127.0.0.1:SHAREPORT (the reverse end).
ctl=$1 key=$2 known=$3 sshport=$4 user=$5 addr=$6
shift 6
reverse=
# The -L options replace the forwards in "$@" (the for loop's list is read once).
for forward do
  case $forward in
    R=*) reverse=${forward#R=} ;;
    *) set -- "$@" -L "$forward" ;;
  esac
  shift
done
# Every ssh here gets the same options: the pinned host key, this key alone (no agent, no
# default keys), no prompt. A session through the control socket falls back to a connection of
# its own when the master is gone; with these options that is one more login of the same key.
# $run is "exec" in the master's subshell: ssh replaces it, so $! is ssh's pid (TERM reaches it).
run=
ssh_to() {
  $run ssh -F none -i "$key" -o IdentitiesOnly=yes -o IdentityAgent=none -o BatchMode=yes \
    -o "UserKnownHostsFile=\"$known\"" -o GlobalKnownHostsFile=/dev/null \
    -o StrictHostKeyChecking=yes -o UpdateHostKeys=no \
    -o Ciphers=aes128-gcm@openssh.com,chacha20-poly1305@openssh.com -o Compression=no \
    -o ServerAliveInterval=1 -o ServerAliveCountMax=3 -o ConnectTimeout=10 \
    -p "$sshport" -l "$user" "$@"
}
master='' stopping=''
trap 'stopping=1; if [ -n "$master" ]; then kill -TERM "$master" 2>/dev/null; else exit 143; fi' TERM INT
mkdir -p "${ctl%/*}"
# A socket left by a master that died would make the new one run without multiplexing.
rm -f "$ctl"
(run="exec"; ssh_to -N -M -S "$ctl" -o ControlPersist=no -o ExitOnForwardFailure=yes "$@" "$addr") &
master=$!
i=0
until ssh_to -S "$ctl" -O check "$addr" >/dev/null 2>&1; do
  if ! kill -0 "$master" 2>/dev/null; then
    wait "$master"
    exit
  fi
  i=$((i + 1))
  if [ "$i" -gt 10 ]; then
    echo "ssh-forward: the master to $addr did not answer on $ctl within 10 s" >&2
    kill -TERM "$master" 2>/dev/null
    wait "$master"
    exit 1
  fi
  sleep 1
done
ssh_to -S "$ctl" -o ControlMaster=no -T -n "$addr" nudge </dev/null
rc=$?
if [ "$rc" -ne 1 ]; then
  echo "ssh-forward: the nudge session to $addr exited $rc, not 1 (the key's forced command):" \
    "sshd may leave Nagle on for this connection" >&2
fi
state=
while [ -n "$reverse" ] && [ -z "$stopping" ] && kill -0 "$master" 2>/dev/null; do
  if out=$(ssh_to -S "$ctl" -O forward -R "$reverse" "$addr" 2>&1 >/dev/null); then
    [ "$state" = up ] || echo "ssh-forward: the reverse end $reverse to $addr holds" >&2
    state=up
  else
    [ "$state" = down ] || echo "ssh-forward: the reverse end $reverse to $addr failed (tried" \
      "again every 10 s; the RPC ports are not affected): $out" >&2
    state=down
  fi
  sleep 10 &
  wait "$!"
done
# wait returns early when a trapped signal arrives: wait again until the master is gone.
while :; do
  wait "$master"
  rc=$?
  kill -0 "$master" 2>/dev/null || break
done
exit "$rc"
