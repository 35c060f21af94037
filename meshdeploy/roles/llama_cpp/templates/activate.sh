# Flip `current` to one installed build atomically and prune old builds beyond KEEP, never the
# one just activated. Inputs: TARGET (the link's target, relative), CURRENT (the link), BUILDS
# (the builds folder), KEY (the build just activated), KEEP (builds kept besides it).
set -e
ln -sfn "$TARGET" "$CURRENT.tmp" && mv -Tf "$CURRENT.tmp" "$CURRENT"
# shellcheck disable=SC2010 # ls -t: newest first (POSIX find cannot sort); entries are build keys
cd "$BUILDS" && ls -1t | grep -vxF -- "$KEY" | grep -v '\.tmp$' | tail -n +"$((KEEP + 1))" | while read -r old; do rm -rf -- "$old"; done
