# The network.SshLogin fact (facts.py says what it returns), run as the login user: its name
# and uid, the sshd host keys' public halves (the system's and, under Termux only, the app
# prefix's: elsewhere PREFIX is any user's variable, and a key there is not sshd's), sshd's
# AuthorizedKeysFile where its config is readable, and the lines of the user's authorized_keys
# that carry a meshdeploy-rpc: marker. One awk reads every file (each file a process of its
# own cost a plan of many hosts a tenth of a second). Inputs: none.
echo "user=$(id -un)"
echo "uid=$(id -u)"
etc=/etc/ssh
termux=
case "${PREFIX:-}" in */com.termux/files/usr) termux=yes ;; esac
[ -n "${TERMUX_VERSION:-}" ] && [ -n "${PREFIX:-}" ] && termux=yes
[ -n "$termux" ] && etc="$PREFIX/etc/ssh"
A="$HOME/.ssh/authorized_keys"
[ -L "$A" ] && echo authorized_link=yes
# The files in the order read; only readable regular ones (awk stops at one it cannot open).
# sshd takes a keyword's first value; Debian's and Fedora's sshd_config include sshd_config.d
# at the top, so its files come first.
set --
for d in /etc/ssh ${termux:+"$PREFIX/etc/ssh"}; do
  for f in "$d"/ssh_host_*_key.pub; do
    [ -f "$f" ] && [ -r "$f" ] && set -- "$@" "$f"
  done
done
for f in "$etc"/sshd_config.d/*.conf "$etc/sshd_config" "$A"; do
  [ -f "$f" ] && [ -r "$f" ] && set -- "$@" "$f"
done
[ $# -gt 0 ] || exit 0
# A host key file's first line; in a config, the first AuthorizedKeysFile before a Match block
# (whose value is not the default: the rest of that file is skipped); in authorized_keys, the
# lines with a marker.
A="$A" awk 'FNR == 1 { skip = 0 }
  FILENAME == ENVIRON["A"] { if (index($0, "meshdeploy-rpc:")) print "authorized=" $0; next }
  FILENAME ~ /\/ssh_host_[^\/]*_key\.pub$/ { if (FNR == 1) print "host_key=" $0; next }
  skip || found { next }
  tolower($1) == "match" { skip = 1; next }
  tolower($1) == "authorizedkeysfile" {
    sub(/^[ \t]*[^ \t]+[ \t]+/, ""); print "keys_file=" $0; found = 1 }' "$@"
true
