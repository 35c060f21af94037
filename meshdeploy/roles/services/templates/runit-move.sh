# Put a runit service folder's new run and log/run (written under NEW, a dot-name beside DIR that
# runsvdir ignores) in place. A new folder is moved in whole: runsv checks for log/ only when it
# starts, so it must never see the folder without it. An existing folder gets each file
# replaced atomically (mv within one filesystem).
# Inputs: DIR, NEW.
if [ -d "$DIR" ]; then
  mkdir -p "$DIR/log" && mv -f "$NEW/log/run" "$DIR/log/run" && mv -f "$NEW/run" "$DIR/run" \
    && rm -rf "$NEW"
else
  mv "$NEW" "$DIR"
fi
