# The services.Rtt fact (facts.py says what it returns): for each "address:port" in "$@", the
# best of three TCP connects in microseconds, less what measuring costs here (a connect refused
# on loopback), or "-" where no connect got an answer. Inputs: the targets as "$@".
# One bash per target (under `timeout 2`) opens the connections (/dev/tcp) and times them with
# its own clock, $EPOCHREALTIME (bash 5), or `date` where bash is older; it prints the best so
# far after each answered connect and stops at the first that got none (a refused connect is a
# round trip too: the host answered). Its messages are read in the C locale. Each target used
# to cost about twenty processes, which a plan of many workers pays on every orchestrator.
# shellcheck disable=SC2016 # bash expands the $ of TRY, its own script
TRY='now() {
  if [ -n "${EPOCHREALTIME:-}" ]; then t=${EPOCHREALTIME/[.,]/}; else t=$(date +%s%N); t=${t%???}; fi
  case "$t" in ""|*[!0-9]*) exit 1 ;; esac  # a date without %N (BSD, busybox): no clock
}
b=
for _ in 1 2 3; do
  now; s=$t
  r=$( { exec 3<>"/dev/tcp/$1/$2"; } 2>&1 ) || case "$r" in *refused*) ;; *) break ;; esac
  now; m=$(( t - s ))
  if [ -z "$b" ] || [ "$m" -lt "$b" ]; then b=$m; fi
  echo "$b"
done'
nl='
'
best() {
  r=$(LC_ALL=C timeout 2 bash -c "$TRY" rtt "$1" "$2" 2>/dev/null) || :
  r=${r##*"$nl"}
  case "$r" in ''|*[!0-9]*) echo - ;; *) echo "$r" ;; esac
}
base=$(best 127.0.0.1 1)
[ "$base" = - ] && base=0
for ep in "$@"; do
  t=$(best "${ep%:*}" "${ep##*:}")
  if [ "$t" = - ]; then echo "$ep -"; else echo "$ep $(( t > base ? t - base : 0 ))"; fi
done
