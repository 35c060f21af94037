# The network.SshLogin fact (facts.py says what it returns), run as the login user: its name,
# the sshd host keys' public halves (the system's and, under Termux only, the app prefix's:
# elsewhere PREFIX is any user's variable, and a key there is not sshd's), sshd's
# AuthorizedKeysFile where its config is readable, and the lines of the user's authorized_keys
# that carry a meshdeploy-rpc: marker. Inputs: none.
echo "user=$(id -un)"
etc=/etc/ssh
termux=
case "${PREFIX:-}" in */com.termux/files/usr) termux=yes ;; esac
[ -n "${TERMUX_VERSION:-}" ] && [ -n "${PREFIX:-}" ] && termux=yes
[ -n "$termux" ] && etc="$PREFIX/etc/ssh"
for d in /etc/ssh ${termux:+"$PREFIX/etc/ssh"}; do
  for f in "$d"/ssh_host_*_key.pub; do
    [ -f "$f" ] && sed -n '1s/^/host_key=/p' "$f"
  done
done
# sshd takes a keyword's first value; Debian's and Fedora's sshd_config include sshd_config.d
# at the top, so its files come first. A Match block's value is not the default: stop there.
for c in "$etc"/sshd_config.d/*.conf "$etc/sshd_config"; do
  [ -f "$c" ] && [ -r "$c" ] && awk 'tolower($1) == "match" { exit }
    tolower($1) == "authorizedkeysfile" { sub(/^[ \t]*[^ \t]+[ \t]+/, ""); print "keys_file=" $0; exit }' "$c"
done | sed -n 1p
a="$HOME/.ssh/authorized_keys"
[ -L "$a" ] && echo authorized_link=yes
[ -f "$a" ] && grep -e 'meshdeploy-rpc:' "$a" | sed 's/^/authorized=/'
true
