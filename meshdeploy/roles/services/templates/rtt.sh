# The services.Rtt fact (facts.py says what it returns): for each "address:port" in "$@", the
# best of three TCP connects in microseconds, less what measuring costs here (a connect refused
# on loopback), or "-" where no connect got an answer. Inputs: the targets as "$@". bash opens
# the connection (/dev/tcp), each connect gets 2 s; its message is read in the C locale.
# ms: one connect's microseconds, or - when it neither connected nor was refused (a refused
# connect is a round trip too: the host answered).
ms() {
  s=$(date +%s%N)
  c=0
  # shellcheck disable=SC2016 # bash expands $1 and $2, its own arguments
  r=$(LC_ALL=C timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' rtt "$1" "$2" 2>&1) || c=$?
  e=$(date +%s%N)
  case "$c $r" in
    "0 "*|*refused*) echo $(( (e - s) / 1000 )) ;;
    *) echo - ;;
  esac
}
# best: the fastest of three, or - after the first try that got no answer (not tried again).
best() {
  b=
  for _ in 1 2 3; do
    t=$(ms "$1" "$2")
    [ "$t" = - ] && break
    if [ -z "$b" ] || [ "$t" -lt "$b" ]; then b=$t; fi
  done
  echo "${b:--}"
}
base=$(best 127.0.0.1 1)
[ "$base" = - ] && base=0
for ep in "$@"; do
  t=$(best "${ep%:*}" "${ep##*:}")
  if [ "$t" = - ]; then echo "$ep -"; else echo "$ep $(( t > base ? t - base : 0 ))"; fi
done
