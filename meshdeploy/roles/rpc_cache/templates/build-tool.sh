# Build md-rpc-seed from its shipped source. Inputs (assigned above by rpc_cache.seed_tool): HOST,
# CC (a fixed default, "cc -O2": split into words on purpose), BIN, SRC, SHA, STAMP; the stamp
# (the source's sha256) is written only after a good build.
command -v cc >/dev/null 2>&1 || { echo "$HOST: no C compiler (cc) to build md-rpc-seed; the toolchain role installs one" >&2; exit 1; }
# shellcheck disable=SC2086 # $CC is "cc -O2": a command and its flags
$CC -o "$BIN.tmp" "$SRC" && mv -f "$BIN.tmp" "$BIN" && echo "$SHA" > "$STAMP.tmp" && mv -f "$STAMP.tmp" "$STAMP"
