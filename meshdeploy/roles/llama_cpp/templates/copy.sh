# Install the build KEY copied from BUILDER's md-share: wait until BUILDER serves it (it starts
# md-share in this same step slot), fetch the tarball, check its sha256 against EXPECT, the one
# BUILDER computed (read from BUILDER by meshdeploy over SSH, never taken from the LAN), unpack
# it beside the other builds and run its binaries on this host; `current` is left alone
# (activate.sh flips it).
# Inputs (assigned above by core.shell.template): URL (the tarball), SUMURL (its sha256), EXPECT,
# SIZE (the tarball's bytes, read from BUILDER with EXPECT), OUT (builds/KEY), KEY, COMMIT,
# BUILDER, HOST, WAIT (seconds to wait for md-share), ARCHIVE (the tarball's path on BUILDER,
# for the message when it is damaged); md_progress and md_sha256 come from the prelude
# (core/progress.py, core.shell.SHA256).
set -e
# What this writes is readable by all (the services' users run the binaries), whatever umask
# the session brought; modes from the archive are not kept (below).
umask 022

# md_fetch URL MAX FILE [CURL OPTION...]: URL's body into FILE, at most MAX bytes. Returns 1 when
# curl fails, 2 when the body is longer than MAX; FILE is removed then. No more than MAX + 1
# bytes are read, whatever the server says of the length (curl's --max-filesize trusts
# Content-Length alone before curl 8.4, and is checked before --fail: a 404 page would count).
md_fetch() {
  md_url=$1 md_max=$2 md_file=$3; shift 3
  rm -f "$md_file" "$md_file.failed"
  { curl -fsS "$@" "$md_url" || : > "$md_file.failed"; } | head -c "$((md_max + 1))" > "$md_file"
  if [ "$(wc -c < "$md_file")" -gt "$md_max" ]; then rm -f "$md_file" "$md_file.failed"; return 2; fi
  if [ -f "$md_file.failed" ]; then rm -f "$md_file" "$md_file.failed"; return 1; fi
}

# md_unprivileged COMMAND...: COMMAND as nobody where this runs as root (setpriv where
# util-linux has it, else sudo -u; no new privileges either way), else as this user: the copied
# binaries run first as nobody, before anything trusts them.
md_unprivileged() {
  if [ "$(id -u)" != 0 ]; then
    "$@"
  elif command -v setpriv >/dev/null 2>&1; then
    setpriv --reuid="$(id -u nobody)" --regid="$(id -g nobody)" --clear-groups --no-new-privs "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo -n -u nobody -- "$@"
  else
    echo "$HOST: the copied binaries run first as nobody, through setpriv or sudo; this host has neither" >&2
    return 127
  fi
}

# An earlier run's copy of this key may have finished while this run was planning.
if [ -f "$OUT/manifest" ] && grep -qx "key=$KEY" "$OUT/manifest"; then echo "$KEY: already installed"; exit 0; fi
TAR="$OUT.tar.tmp"
SUMS="$OUT.sha256.tmp"
rm -rf "$OUT.tmp" "$TAR" "$OUT.plain.tmp" "$SUMS"; mkdir -p "${OUT%/*}"
md_progress phase "wait for $BUILDER"
# Asked every half second (BUILDER packs and starts md-share in about a second) until WAIT
# seconds have passed, however long each try takes (a dropped SYN waits for curl's --max-time).
END=$(($(date +%s) + WAIT))
until md_fetch "$SUMURL" 128 "$SUMS" --max-time 10 2>/dev/null; do
  [ "$?" != 2 ] || { echo "$HOST: $BUILDER serves more than a sha256 for build $KEY; current is unchanged" >&2; exit 1; }
  [ "$(date +%s)" -lt "$END" ] || { echo "$HOST: $BUILDER did not serve build $KEY within $WAIT s (see its llama_cpp.copy step); current is unchanged" >&2; exit 1; }
  sleep 0.5
done
SUM=$(head -c 64 "$SUMS"); rm -f "$SUMS"
if [ "$SUM" != "$EXPECT" ]; then
  echo "$HOST: $BUILDER serves build $KEY with sha256 $SUM, not $EXPECT as it computed; current is unchanged (apply again)" >&2; exit 1
fi
md_progress phase "copy from $BUILDER"
# Fetched again, up to three more times, when a transfer fails: BUILDER's llama_cpp.copy replaces
# an md-share left running by an earlier step or run with its own while this one may be
# fetching from the earlier one (curl's --retry leaves a connection cut midway alone).
n=0
until md_fetch "$URL" "$SIZE" "$TAR"; do
  [ "$?" != 2 ] || { echo "$HOST: $BUILDER serves more than the $SIZE bytes of build $KEY it packed; current is unchanged" >&2; exit 1; }
  n=$((n + 1))
  [ "$n" -lt 4 ] || { rm -f "$TAR"; echo "$HOST: could not fetch build $KEY from $BUILDER; current is unchanged" >&2; exit 1; }
  sleep 2
done
md_progress phase "verify sha256"
GOT=$(md_sha256 "$TAR")
if [ "$GOT" != "$EXPECT" ]; then
  rm -f "$TAR"
  echo "$HOST: refused the copy of build $KEY from $BUILDER: its sha256 is $GOT, $BUILDER computed $EXPECT; current is unchanged" >&2
  echo "hint: if $BUILDER's tarball is damaged, remove $ARCHIVE there: the next apply packs it again" >&2
  exit 1
fi
# Unpacked once (gzip costs a copier more than all else it does), then read twice: only plain
# files and folders below the build, no links, devices, absolute or .. names.
# Its name ends in .tmp, as every partial thing under builds/ does: activate.sh's pruning skips it.
PLAIN="$OUT.plain.tmp"
gzip -dc "$TAR" > "$PLAIN" || { rm -f "$TAR" "$PLAIN"; echo "$HOST: could not unpack the copy of build $KEY from $BUILDER (not a gzip archive, or the disk is full: df $OUT)" >&2; exit 1; }
rm -f "$TAR"
if tar -tvf "$PLAIN" | grep -qv '^[-d]' || tar -tf "$PLAIN" | grep -qE '^/|(^|/)\.\.(/|$)'; then
  rm -f "$PLAIN"; echo "$HOST: refused the copy of build $KEY from $BUILDER: the archive holds more than files and folders" >&2; exit 1
fi
mkdir -p "$OUT.tmp"
# Owned by this user, modes under the umask: no setuid, setgid or sticky bit from the archive
# (root's tar keeps them by default: a 4755 entry would unpack setuid-root).
tar -xf "$PLAIN" -C "$OUT.tmp" --no-same-owner --no-same-permissions || { rm -rf "$PLAIN" "$OUT.tmp"; echo "$HOST: could not unpack build $KEY into $OUT.tmp (is the disk full?); current is unchanged" >&2; exit 1; }
rm -f "$PLAIN"
grep -qx "key=$KEY" "$OUT.tmp/manifest" ||
  { rm -rf "$OUT.tmp"; echo "$HOST: the archive from $BUILDER is not build $KEY" >&2; exit 1; }
# The binaries must run here before they can become current: llama-server tells its commit, the
# RPC worker (no --version) answers --help; "Illegal instruction" or a missing library ends here.
# They run as nobody (md_unprivileged) where this is root.
SHORT=$(printf '%.7s' "$COMMIT")
RPC=$(sed -n 's/^rpc_binary=//p' "$OUT.tmp/manifest")
if [ -x "$OUT.tmp/bin/llama-server" ]; then
  V=$(cd / && md_unprivileged "$OUT.tmp/bin/llama-server" --version 2>&1) || { rm -rf "$OUT.tmp"; printf '%s: the copied llama-server does not run here:\n%s\n' "$HOST" "$V" >&2; exit 1; }
  case "$V" in *"$SHORT"*) ;; *) rm -rf "$OUT.tmp"; printf '%s: the copied llama-server reports\n%s\nnot commit %s\n' "$HOST" "$V" "$SHORT" >&2; exit 1 ;; esac
  # A cross-compiled build never ran where it was built: its options are read here (the
  # Builds fact reads them from this file).
  if [ ! -f "$OUT.tmp/llama-server.help" ]; then (cd / && md_unprivileged "$OUT.tmp/bin/llama-server" --help) > "$OUT.tmp/llama-server.help" 2>&1 || { rm -rf "$OUT.tmp"; echo "$HOST: the copied llama-server --help failed here" >&2; exit 1; }; fi
fi
if [ -n "$RPC" ] && [ -x "$OUT.tmp/bin/$RPC" ]; then
  C=0; V=$(cd / && md_unprivileged "$OUT.tmp/bin/$RPC" --help 2>&1) || C=$?
  [ "$C" -lt 128 ] || { rm -rf "$OUT.tmp"; printf '%s: the copied %s does not run here (exit %s):\n%s\n' "$HOST" "$RPC" "$C" "$V" >&2; exit 1; }
fi
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
echo "$KEY: copied from $BUILDER, sha256 $GOT"
