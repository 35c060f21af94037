# The network.SshLogin fact (facts.py says what it returns), run as the login user: its name,
# the sshd host keys' public halves (the system's and, under Termux, the app prefix's), and the
# lines of the user's authorized_keys that carry a meshdeploy-rpc: marker. Inputs: none.
echo "user=$(id -un)"
for d in /etc/ssh "${PREFIX:-/nonexistent}/etc/ssh"; do
  for f in "$d"/ssh_host_*_key.pub; do
    [ -f "$f" ] && sed -n '1s/^/host_key=/p' "$f"
  done
done
a="$HOME/.ssh/authorized_keys"
[ -L "$a" ] && echo authorized_link=yes
[ -f "$a" ] && grep -e 'meshdeploy-rpc:' "$a" | sed 's/^/authorized=/'
true
