# The models.OllamaManifest fact (facts.py says what it returns): an Ollama manifest, the size and
# mtime of each blob it names and, of the model blob, its header (the first 64 KiB: enough for
# its architecture string, not its weights). Inputs: S (the store), R (the manifest's registry
# path); st FILE ("<size> <mtime>") comes from the prelude.
M="$S/manifests/$R"
[ -f "$M" ] || exit 0; echo "store $S"; echo "manifest $(tr -d '\n' < "$M")"
# shellcheck disable=SC2013 # grep -o prints one digest a line: a word is a line
for dg in $(grep -o 'sha256:[0-9a-f]\{64\}' "$M" | sort -u); do f="$S/blobs/sha256-${dg#sha256:}"; echo "blob $dg $(st "$f")"; [ "$(head -c 4 "$f" 2>/dev/null)" = GGUF ] && echo "gguf $dg $(head -c 65536 "$f" | base64 | tr -d '\n')"; done
