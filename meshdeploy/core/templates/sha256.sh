# Shell functions for a script's prelude (loaded as core.shell.SHA256; no inputs).
# md_sha256 FILE: FILE's sha256, 64 hex digits, on standard output (an empty line when it cannot
# be read). OpenSSL's where the host has it (Debian's ca-certificates depends on it): its
# assembly uses the CPU's SHA extensions, coreutils' sha256sum does not (241 MB: 0.13 s against
# 0.58 s of CPU on an x86-64 with them); else, or when its answer is not a digest (an OpenSSL
# without -r), sha256sum, else shasum (macOS).
md_sha256() {
  md_h=
  if command -v openssl >/dev/null 2>&1; then
    md_h=$(openssl dgst -sha256 -r "$1" 2>/dev/null | cut -c1-64)
  fi
  if [ "${#md_h}" -ne 64 ]; then
    if command -v sha256sum >/dev/null 2>&1; then md_h=$(sha256sum "$1" 2>/dev/null | cut -c1-64)
    else md_h=$(shasum -a 256 "$1" 2>/dev/null | cut -c1-64); fi
  fi
  printf '%s\n' "$md_h"
}
