# The network.SshdStreamLocal fact (facts.py says what it returns), run as root: meshdeploy's
# sshd_config drop-in (FILE) as it is, whether sshd_config includes sshd_config.d, and the
# AllowStreamLocalForwarding that sshd applies to the login user (who ran sudo) logging in from
# ADDR (`sshd -T -C`: the configuration a new connection gets). Inputs: FILE, ADDR.
PATH="$PATH:/usr/sbin:/sbin"
user=${SUDO_USER:-$(id -un)}
echo "user=$user"
if [ -f "$FILE" ] && [ ! -L "$FILE" ]; then
  head -c 4096 "$FILE" | sed 's/^/line=/'
  echo "file=yes"
fi
# Absolute or relative (sshd reads a relative Include against /etc/ssh).
grep -Eiq '^[[:space:]]*Include[[:space:]]+(/etc/ssh/)?sshd_config\.d/' /etc/ssh/sshd_config \
  2>/dev/null && echo include=yes
if command -v sshd >/dev/null 2>&1; then
  echo "effective=$(sshd -T -C "user=$user,host=$ADDR,addr=$ADDR" 2>/dev/null |
    awk '$1 == "allowstreamlocalforwarding" { print $2; exit }')"
fi
true
