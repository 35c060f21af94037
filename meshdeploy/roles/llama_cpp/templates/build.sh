# Build llama-server and/or the RPC worker of one (commit, backend, flags) and install it under
# $OUT. Inputs (assigned above by core.shell.template): SRC TREE OUT COMMIT NUMBER JOBS CCACHE
# WANT_SERVER WANT_RPC RPC_TARGETS KEY BACKEND FORCE (1: compile even when installed) CROSS
# (empty, or the machine the build is cross-compiled for: aarch64) TRIPLET (its GNU triplet:
# Debian's cross compilers are <triplet>-gcc and <triplet>-g++) CROSS_ROOT (where the target's C
# library and headers are);
# "$@" = the cmake flags.
set -e
if [ -n "$CCACHE" ]; then export CCACHE_DIR="$CCACHE"; fi
# One locale for every compile: ccache hashes LANG, LC_ALL, LC_CTYPE and LC_MESSAGES (they change
# the compiler's messages), so a build started from a shell with another locale (an SSH client's
# LANG passed through, a local run's LC_CTYPE) would miss every entry another run wrote.
export LANG=C LC_ALL=C; unset LANGUAGE LC_CTYPE LC_MESSAGES
# Paths under the prefix (the folder two above $SRC) are hashed relative to it, so hosts
# with other prefixes (a rootless host's is its user's) reuse each other's entries in a shared cache.
export CCACHE_BASEDIR="${SRC%/*/*}"
# The worker's target name changed upstream; ask the tree which one it has.
RPC=''; for t in $RPC_TARGETS; do grep -rqs --include=CMakeLists.txt "set(TARGET $t)" "$SRC/tools/rpc" "$SRC/examples/rpc" && { RPC=$t; break; }; done
TARGETS=''
if [ "$WANT_SERVER" = 1 ]; then TARGETS=llama-server; fi
if [ "$WANT_RPC" = 1 ]; then
  [ -n "$RPC" ] || { echo "no RPC worker target in this llama.cpp tree" >&2; exit 1; }
  TARGETS="$TARGETS $RPC"
fi
# An earlier run's build of this key, with these targets, may have finished while this run was
# planning.
if [ "$FORCE" != 1 ] && [ -f "$OUT/manifest" ] && grep -qx "commit=$COMMIT" "$OUT/manifest" && grep -qx "targets=$TARGETS" "$OUT/manifest"; then echo "$KEY: already built"; exit 0; fi
[ -n "$JOBS" ] || JOBS=$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu)
[ -n "$NUMBER" ] || NUMBER=$(git -C "$SRC" rev-list --count HEAD)
mkdir -p "$TREE" "${OUT%/*}"
[ "$(git -C "$SRC" rev-parse HEAD)" = "$COMMIT" ] || { echo "source is not at $COMMIT" >&2; exit 1; }
SHORT=$(printf '%.7s' "$COMMIT")
# HIP: the compiler and its ROCm as llama.cpp's docs/build.md says (HIPCXX from hipconfig).
if [ "$BACKEND" = rocm ] && [ -z "${HIPCXX-}" ]; then HIPCXX=$(hipconfig -l); HIPCXX=${HIPCXX%/}/clang; HIP_PATH=$(hipconfig -R); export HIPCXX HIP_PATH; fi
# Cross-compiling: a cmake toolchain file beside the tree (cmake's own way: the system and
# processor it builds for, the cross compilers, and libraries and headers from the target's
# root only, programs from this host's).
if [ -n "$CROSS" ]; then
  printf 'set(CMAKE_SYSTEM_NAME Linux)\nset(CMAKE_SYSTEM_PROCESSOR %s)\nset(CMAKE_C_COMPILER %s-gcc)\nset(CMAKE_CXX_COMPILER %s-g++)\nset(CMAKE_FIND_ROOT_PATH %s)\nset(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)\nset(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)\nset(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)\nset(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)\n' "$CROSS" "$TRIPLET" "$TRIPLET" "$CROSS_ROOT" > "$TREE.toolchain.cmake"
  set -- "$@" "-DCMAKE_TOOLCHAIN_FILE=$TREE.toolchain.cmake"
fi
md_progress phase configure
cmake -S "$SRC" -B "$TREE" -G Ninja "$@" "-DLLAMA_BUILD_NUMBER=$NUMBER" "-DLLAMA_BUILD_COMMIT=$SHORT" > "$TREE.configure.log" 2>&1 || { tail -n 30 "$TREE.configure.log" >&2; exit 1; }
# GGML_OPENMP=ON falls back to ggml's own threads where cmake finds no OpenMP: a build that
# would differ from the same key's build elsewhere stops here instead.
if grep -qx 'GGML_OPENMP:BOOL=ON' "$TREE/CMakeCache.txt" && grep -qx 'GGML_OPENMP_ENABLED:INTERNAL=OFF' "$TREE/CMakeCache.txt"; then echo "GGML_OPENMP=ON but cmake found no OpenMP for this compiler (install its OpenMP runtime, e.g. libgomp with g++)" >&2; exit 1; fi
# Live progress: ninja's last "[done/total]" line of the log, every 2 s (core/progress.py).
build_progress() { L=$(tail -n 200 "$TREE.build.log" 2>/dev/null | grep -a '^\[[0-9]*/[0-9]*\]' | tail -n 1); [ -z "$L" ] || md_progress build "$L"; }
export NINJA_STATUS='[%f/%t] '
: > "$TREE.build.log"; md_watch build_progress; C=0
# shellcheck disable=SC2086 # TARGETS: one or two target names, split into words on purpose
cmake --build "$TREE" --target $TARGETS -j "$JOBS" > "$TREE.build.log" 2>&1 || C=$?
md_unwatch; [ "$C" = 0 ] || { tail -n 40 "$TREE.build.log" >&2; exit 1; }
md_progress phase install
rm -rf "$OUT.tmp"; mkdir -p "$OUT.tmp/bin"
for t in $TARGETS; do cp "$TREE/bin/$t" "$OUT.tmp/bin/"; done
# A shared build (runtime CPU dispatch): its libraries, libggml-cpu-<variant>.so among them, go
# beside the binaries, which must find them there ($ORIGIN) and nowhere in this build tree. As
# plain files (a copy refuses links): each library under the name the binaries load, its soname
# (libllama.so.0) or its only name (a module such as libggml-cpu-haswell.so); not the linker's
# libllama.so link, nor the versioned file behind the soname.
for f in "$TREE/bin/"*.so "$TREE/bin/"*.so.*; do
  [ -e "$f" ] || continue
  case "${f##*/}" in
    *.so) if [ -L "$f" ]; then continue; fi ;;
    *.so.[0-9]|*.so.[0-9][0-9]) ;;
    *) continue ;;
  esac
  cp -L "$f" "$OUT.tmp/bin/"
done
# root_only DIR: DIR, the folder it resolves to, and every folder above each belong to root and
# no one else may write them (a link is only as safe as the folders holding it).
root_only() {
  r=$(cd -P "$1" 2>/dev/null && pwd -P) || return 1
  for d in "$1" "$r"; do
    while :; do
      s=$(stat -L -c '%u %a' "$d" 2>/dev/null) || return 1
      [ "${s%% *}" = 0 ] && [ $(( 0${s#* } & 022 )) = 0 ] || return 1
      [ "$d" = / ] && break
      d=${d%/*}; [ -n "$d" ] || d=/
    done
  done
}
for f in "$OUT.tmp/bin/"*; do
  P=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(R\(UN\)\{0,1\}PATH).*\[\(.*\)\]$/\2/p')
  # NVIDIA's CUDA toolkit keeps libcudart and libcublas in a library folder inside its own
  # install folder, and cmake names that folder in the RUNPATH of a CUDA build: such an entry
  # (it holds libcudart) is kept where root alone can write it and every folder above it. A host
  # the build is copied to runs the binaries before they become current (copy.sh), so one
  # without that toolkit stops there, with the loader's message.
  OK=''
  if [ "$BACKEND" = cuda ]; then
    OK=$(printf '%s\n' "$P" | tr ':' '\n' | while IFS= read -r e; do
      case "$e" in /*) ;; *) continue ;; esac
      for l in "$e/libcudart.so"*; do
        if [ -f "$l" ] && root_only "$e"; then printf '%s\n' "$e"; fi
        break
      done
    done)
  fi
  # $ORIGIN (cmake writes "$ORIGIN:", an empty entry after it), the system's own library
  # folders (root's on every host; Debian's NVIDIA driver keeps libcuda.so.1 in the nvidia
  # folder of the system's library folder, and cmake names it for a CUDA build) and the CUDA
  # toolkit's folder above are kept; any other entry (the build tree, a user's folder) is
  # refused.
  # shellcheck disable=SC2016 # $ORIGIN: the loader's word, matched as it is written
  Q=$(printf '%s\n' "$P" | tr ':' '\n' | MD_KEEP="$OK" awk 'BEGIN { n = split(ENVIRON["MD_KEEP"], k, "\n"); for (i = 1; i <= n; i++) if (k[i] != "") keep[k[i]] = 1 }
    $0 != "" && $0 != "$ORIGIN" && !($0 in keep) && \
    ($0 !~ /^\/(usr\/)?lib(64)?(\/[A-Za-z0-9_.+-]+)*\/?$/ || $0 ~ /\.\./)')
  if [ -n "$Q" ]; then echo "$f: RPATH $P is not \$ORIGIN, a system library folder or the CUDA toolkit's (root's alone): the copy would not find its libraries" >&2; exit 1; fi
done
# Binaries must run before they can become current (a cross build's run first where they are
# copied: copy.sh).
if [ -z "$CROSS" ] && [ -x "$OUT.tmp/bin/llama-server" ]; then "$OUT.tmp/bin/llama-server" --help > "$OUT.tmp/llama-server.help" 2>&1; fi
if [ -z "$CROSS" ] && [ -n "$RPC" ] && [ -x "$OUT.tmp/bin/$RPC" ]; then "$OUT.tmp/bin/$RPC" --help > "$OUT.tmp/rpc-server.help" 2>&1; fi
PROTO=$(awk '/define RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION/ {printf "%s%s", s, $3; s="."}' "$SRC/ggml/include/ggml-rpc.h" 2>/dev/null)
printf 'commit=%s\nbackend=%s\nkey=%s\nrpc_binary=%s\ntargets=%s\nproto=%s\n' "$COMMIT" "$BACKEND" "$KEY" "$RPC" "$TARGETS" "$PROTO" > "$OUT.tmp/manifest"
rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
