# Generate the host's WireGuard key pair on the host: the private key goes from `wg genkey` into
# a root-only file and never into an argument, the probe, the plan or a log; a running interface
# takes it at once. Inputs: DIR (the key's folder), KEY (the private key file), IFACE.
PATH="$PATH:/usr/sbin:/sbin"
umask 077
mkdir -p "$DIR" && chmod 700 "$DIR" && wg genkey > "$KEY.new" && mv -f "$KEY.new" "$KEY"
if wg show "$IFACE" public-key >/dev/null 2>&1; then wg set "$IFACE" private-key "$KEY"; fi
