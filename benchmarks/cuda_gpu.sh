#!/usr/bin/env bash
# Runs on a machine with an NVIDIA GPU, as root, with no SSH and no internet: what
# `benchmarks/cuda_gpu.py prepare DIR` put in DIR (the build scripts meshdeploy renders for the
# cluster file DIR/cluster.yaml, the llama.cpp tree, the gguf wheel, the fact commands), then:
#   the host's facts (nvidia-smi, the DeviceMemory and CudaCompute probes) -> OUT/facts
#   the two builds (the gpu host's rpc-server, CUDA; the orchestrator's llama-server, CPU)
#   a synthetic model written with gguf
#   the worker `ggml-rpc-server -d CUDA0` and `llama-server --rpc` at each -ngl of NGLS, with
#   llama.cpp's buffer lines and the timings of a few completions
# Everything lands in OUT (one tarball, OUT/gpu-run.tar.gz, and run.log beside it).
#     bash benchmarks/cuda_gpu.sh DIR OUT [DEADLINE_S]
# DEADLINE_S (default 540): the builds are stopped where they are at DEADLINE_S - 150 s and the
# runs skipped, so the logs always come back. Not in CI (no GPU there): docs/gpu.md.
set -u
DIR=$(cd "$1" && pwd); OUT=$2; DEADLINE=${3:-540}
REPO=$(cd "$(dirname "$0")/.." && pwd)
START=$(date +%s)
mkdir -p "$OUT/work"; W=$OUT/work
exec > >(tee "$OUT/run.log") 2>&1
say() { printf '[%4ds] %s\n' "$(( $(date +%s) - START ))" "$*"; }
left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
finish() {
  say "packing $W"
  tar -C "$OUT" -czf "$OUT/gpu-run.tar.gz" work
  say "done"
  exit 0
}
. "$DIR/settings.sh"   # PREFIX COMMIT NGLS MODEL_SHAPE PORT CTX WORKER_DEVICE ORCH_OUT GPU_OUT
cp "$DIR/settings.sh" "$DIR/cluster.yaml" "$W/"

command -v nvcc > /dev/null || export PATH=$PATH:/usr/local/cuda/bin
say "facts"
{ nvidia-smi; } > "$W/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=name,compute_cap,memory.total,memory.free,driver_version --format=csv \
  > "$W/nvidia-smi-query.csv" 2>&1
nvidia-smi -q > "$W/nvidia-smi-q.txt" 2>&1
sh "$DIR/fact-DeviceMemory.sh" > "$W/fact-DeviceMemory.txt" 2>&1
sh "$DIR/fact-CudaCompute.sh" > "$W/fact-CudaCompute.txt" 2>&1
{ uname -a; nproc; grep -m1 'model name' /proc/cpuinfo; free -b; command -v nvcc git cmake ninja gcc;
  nvcc --version; cmake --version | head -1; gcc --version | head -1; git --version;
  ldconfig -p | grep -E 'libcudart|libcublas|libgomp' ; } > "$W/machine.txt" 2>&1
cat "$W/nvidia-smi-query.csv" "$W/fact-CudaCompute.txt"

say "source: the tree, committed as prepare committed it"
SRC=$PREFIX/src/llama.cpp
rm -rf "$SRC"; mkdir -p "$SRC" "$PREFIX/models"
tar -xJf "$DIR/llama.cpp.tar.xz" -C "$SRC"
. "$DIR/commit.sh"; commit_tree "$SRC"
HEAD=$(git -C "$SRC" rev-parse HEAD 2>/dev/null)
echo "HEAD $HEAD, prepared $COMMIT"
[ "$HEAD" = "$COMMIT" ] || { say "the tree's commit differs: the builds would refuse it"; finish; }

say "model (gguf) and the two builds, side by side"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$DIR"/gguf-*.whl \
  > "$W/pip.log" 2>&1
MODEL=$PREFIX/models/synthetic.gguf
( t=$(date +%s)
  PYTHONPATH=/tmp/site:$REPO/tests python3 -c "
import json, sys
from pathlib import Path
from support.synthetic import Shape, write_llama
write_llama(Path(sys.argv[1]), Shape(**json.loads(sys.argv[2])))" "$MODEL" "$MODEL_SHAPE" \
    > "$W/model.log" 2>&1
  echo "model written in $(( $(date +%s) - t )) s: $(stat -c %s "$MODEL" 2>/dev/null) bytes" >> "$W/model.log"
) &
MODEL_PID=$!
build() {  # name script niceness
  local t; t=$(date +%s)
  nice -n "$3" bash "$DIR/$2" > "$W/build-$1.log" 2>&1; local c=$?
  echo "exit $c after $(( $(date +%s) - t )) s" >> "$W/build-$1.log"
}
setsid bash -c "$(declare -f build); DIR=$DIR W=$W; build gpu build-gpu.sh 0" & GPU_PID=$!
setsid bash -c "$(declare -f build); DIR=$DIR W=$W; build orch build-orch.sh 10" & ORCH_PID=$!
while kill -0 "$GPU_PID" 2>/dev/null || kill -0 "$ORCH_PID" 2>/dev/null; do
  if [ "$(left)" -lt 150 ]; then
    say "out of time: stopping the builds"
    kill -TERM -- "-$GPU_PID" "-$ORCH_PID" 2>/dev/null; sleep 2
    kill -KILL -- "-$GPU_PID" "-$ORCH_PID" 2>/dev/null
    break
  fi
  sleep 5
done
wait "$MODEL_PID"
say "builds: gpu $(tail -n1 "$W/build-gpu.log"), orch $(tail -n1 "$W/build-orch.log")"
cat "$W/model.log"
for log in "$PREFIX/build/"*.build.log; do
  grep -a '^\[[0-9]*/[0-9]*\]' "$log" 2>/dev/null | tail -n 1
done
cp "$PREFIX/build/"*.build.log "$PREFIX/build/"*.configure.log "$W/" 2>/dev/null
for tree in "$PREFIX/build/"*/; do
  t=${tree%/}; cp "$t/CMakeCache.txt" "$W/${t##*/}.CMakeCache.txt" 2>/dev/null
done
RPC=$GPU_OUT/bin/ggml-rpc-server; SERVER=$ORCH_OUT/bin/llama-server
[ -x "$RPC" ] && [ -x "$SERVER" ] && [ -s "$MODEL" ] || { say "no binaries or no model: no runs"; finish; }
{ for f in "$RPC" "$SERVER"; do ls -l "$f"; readelf -d "$f" | grep -E 'NEEDED|RPATH|RUNPATH';
  cuobjdump --list-elf "$f" 2>/dev/null | sed 's/.*\.\(sm_[0-9a-z]*\)\..*/\1/' | sort | uniq -c; done
  cat "$GPU_OUT/manifest" "$ORCH_OUT/manifest"; } > "$W/binaries.txt" 2>&1

say "worker: $RPC -H 127.0.0.1 -p $PORT -d $WORKER_DEVICE"
"$RPC" -H 127.0.0.1 -p "$PORT" -d "$WORKER_DEVICE" > "$W/rpc-server.log" 2>&1 & RPC_PID=$!
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$PORT) 2>/dev/null && break; sleep 0.2; done
head -n 20 "$W/rpc-server.log"
# Python's urllib, not curl: the GPU machine's image is not known to have curl.
http() {
  python3 - "$@" <<'PY'
import json, sys, urllib.request
if sys.argv[1] == "health":
    urllib.request.urlopen("http://127.0.0.1:8080/health", timeout=2).read()
else:
    body = {"prompt": sys.argv[2], "n_predict": int(sys.argv[3]), "ignore_eos": True,
            "cache_prompt": False, "temperature": 0}
    req = urllib.request.Request("http://127.0.0.1:8080/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    print(json.dumps(json.load(urllib.request.urlopen(req, timeout=120))["timings"]))
PY
}
PROMPT='the quick brown fox jumps over the lazy dog. '
PROMPT=$PROMPT$PROMPT$PROMPT$PROMPT$PROMPT$PROMPT$PROMPT$PROMPT
for ngl in $NGLS; do
  [ "$(left)" -gt 40 ] || { say "out of time before -ngl $ngl"; break; }
  say "llama-server -ngl $ngl"
  "$SERVER" -m "$MODEL" --host 127.0.0.1 --port 8080 --rpc "127.0.0.1:$PORT" -ngl "$ngl" \
    -c "$CTX" --no-webui -lv 4 > "$W/server-ngl$ngl.log" 2>&1 & S=$!
  ok=0
  for _ in $(seq 300); do
    http health > /dev/null 2>&1 && { ok=1; break; }
    kill -0 "$S" 2>/dev/null || break; sleep 0.2
  done
  if [ "$ok" = 1 ]; then
    nvidia-smi --query-gpu=memory.used,memory.free --format=csv,noheader,nounits \
      > "$W/gpu-used-ngl$ngl.txt" 2>&1
    for _ in 1 2 3 4; do
      http completion "$PROMPT" "${N_PREDICT:-128}" >> "$W/timings-ngl$ngl.jsonl" 2>&1
    done
    tail -n 1 "$W/timings-ngl$ngl.jsonl"
  else
    say "llama-server -ngl $ngl never answered /health"; tail -n 15 "$W/server-ngl$ngl.log"
  fi
  kill "$S" 2>/dev/null; wait "$S" 2>/dev/null
  grep -E 'buffer size|offloaded|using device|RPC' "$W/server-ngl$ngl.log" | head -n 20
done
kill "$RPC_PID" 2>/dev/null; wait "$RPC_PID" 2>/dev/null
finish
