# The network.WireGuard fact (facts.py says what it returns): the tools, the kernel module, the
# public key of the key file (never the private key), the wg-quick file's sha256 and the live
# interface. Run as root. Inputs: IFACE, KEY (the private key file), CONF (the wg-quick file).
PATH="$PATH:/usr/sbin:/sbin:/usr/local/bin"
printf 'tools='; for t in wg wg-quick wireguard-go; do command -v "$t" >/dev/null 2>&1 && printf '%s ' "$t"; done; echo
if [ -e /sys/module/wireguard ] || modprobe -nq wireguard 2>/dev/null; then echo kernel=yes; fi
command -v wg >/dev/null 2>&1 || exit 0
[ -s "$KEY" ] && echo "public_key=$(wg pubkey < "$KEY" 2>/dev/null)"
[ -f "$CONF" ] && echo "conf_sha256=$(sha256sum < "$CONF" | cut -d' ' -f1)"
# Enabled: the link `systemctl enable` makes for wg-quick@.service's WantedBy (a file test,
# not a systemctl call: this runs on every host of every plan, tunnel or not).
for w in /etc/systemd/system/*.wants/"wg-quick@$IFACE.service"; do
  if [ -L "$w" ] || [ -e "$w" ]; then echo enabled=yes; break; fi
done
[ -e "/sys/class/net/$IFACE" ] || exit 0
wg show "$IFACE" public-key >/dev/null 2>&1 || exit 0
echo up=yes
echo "live_key=$(wg show "$IFACE" public-key)"
echo "listen_port=$(wg show "$IFACE" listen-port)"
ip -o -4 addr show dev "$IFACE" | while read -r _ _ _ a _; do echo "address=$a"; done
wg show "$IFACE" allowed-ips | while read -r k ips; do echo "peer=$k $ips"; done
wg show "$IFACE" endpoints | while read -r k e; do echo "endpoint=$k $e"; done
