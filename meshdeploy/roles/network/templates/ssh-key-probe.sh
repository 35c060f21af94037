# The network.SshKey fact (facts.py says what it returns): the ssh tools on PATH, whether the
# forwards' private key exists, its public key (derived from the private key by ssh-keygen -y,
# and the .pub file's first line) and the pinned known_hosts file. The private key is read by
# ssh-keygen on the host; only the public key is printed. Run as root on a host with root.
# Inputs: KEY (the private key file), KNOWN (the known_hosts file).
printf 'tools='
for t in ssh ssh-keygen; do command -v "$t" >/dev/null 2>&1 && printf '%s ' "$t"; done
echo
if [ -f "$KEY" ] && [ ! -L "$KEY" ]; then
  echo private=yes
  echo "derived=$(ssh-keygen -y -f "$KEY" </dev/null 2>/dev/null | head -n 1)"
fi
[ -f "$KEY.pub" ] && sed -n '1s/^/public=/p' "$KEY.pub"
[ -f "$KNOWN" ] && echo known=yes && sed 's/^/known_line=/' "$KNOWN"
true
