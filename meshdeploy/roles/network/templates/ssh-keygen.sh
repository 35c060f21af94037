# Make an orchestrator's key pair for its ssh forwards on the host itself: the private key is
# written by ssh-keygen into a 0700 folder (umask 077) and never leaves the host; only its path
# is an argument. The public key moves in first and the private key last, so the SshKey fact
# (which derives the public key from the private one) never sees half a rotation.
# Inputs: DIR (the key's folder), KEY (the private key file), COMMENT (the key's comment).
umask 077
mkdir -p "$DIR" && chmod 700 "$DIR" || exit 1
rm -f "$KEY.new" "$KEY.new.pub"
ssh-keygen -q -t ed25519 -N '' -C "$COMMENT" -f "$KEY.new" </dev/null >/dev/null || exit 1
mv -f "$KEY.new.pub" "$KEY.pub" && mv -f "$KEY.new" "$KEY"
