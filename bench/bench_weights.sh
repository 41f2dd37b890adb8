#!/usr/bin/env bash
# The weights fingerprint (`kvp-admin weights CONFIG`, the check every launch runs) against
# named baselines, as whole-process runs with hyperfine:
#
#   first pass   (no digest cache: every file read and hashed), on REAL_GB GiB of random
#                data: against `sha256sum` and `openssl dgst -sha256` of the same files;
#   cached pass  (one stat per file), on that tree and on a sparse tree of SHARDS shards of
#                SHARD_MB MiB: against `find -printf` of the same stat fields, and against
#                `kvp-admin identity namespace CONFIG` (the same start-up and config load,
#                without the check).
#
# Each comparison runs twice: hyperfine (all runs of one command, then the next's), then
# bench/paired_runs.py (alternating rounds, wall and CPU time, medians of the per-round
# ratios: steadier on a busy machine; the figures docs/benchmarks.md reports).
#
# Usage: PYTHON=/path/to/venv/bin/python bash bench/bench_weights.sh [DIR] [RUNS]
#   DIR   where the trees go (default /var/tmp/kvp-weights-bench; about REAL_GB GiB of disk)
#   RUNS  runs per command (default 5)
# Environment: REAL_GB (3), SHARDS (192), SHARD_MB (256). Results: DIR/results/*.json|md.
# Needs hyperfine (apt-get install hyperfine). Not part of the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DIR=${1:-/var/tmp/kvp-weights-bench}
RUNS=${2:-5}
REAL_GB=${REAL_GB:-3}
SHARDS=${SHARDS:-192}
SHARD_MB=${SHARD_MB:-256}
OUT=$DIR/results
mkdir -p "$DIR" "$OUT"

small_files() {  # the small files every model directory has
  printf '{"model_type": "llama", "num_key_value_heads": 8}\n' >"$1/config.json"
  printf '{"bos_token_id": 1, "eos_token_id": 2}\n' >"$1/generation_config.json"
  head -c 2000000 /dev/urandom | base64 -w0 | sed 's/^/{"v":"/; s/$/"}/' >"$1/tokenizer.json"
  printf '{"chat_template": "x"}\n' >"$1/tokenizer_config.json"
}

real=$DIR/real-${REAL_GB}g
if [ ! -f "$real/config.json" ]; then
  mkdir -p "$real"
  for i in $(seq 1 "$REAL_GB"); do
    head -c 1G /dev/urandom >"$real/model-$(printf %05d "$i")-of-$(printf %05d "$REAL_GB").safetensors"
  done
  small_files "$real"
fi
sparse=$DIR/sparse-${SHARDS}x${SHARD_MB}m
if [ ! -f "$sparse/config.json" ]; then
  mkdir -p "$sparse"
  for i in $(seq 1 "$SHARDS"); do
    f="$sparse/model-$(printf %05d "$i")-of-$(printf %05d "$SHARDS").safetensors"
    printf 'shard %d' "$i" >"$f"  # distinct content, the rest a hole
    truncate -s "${SHARD_MB}M" "$f"
  done
  small_files "$sparse"
fi

kvp() {  # kvp TREE ARGS...: the command line of kvp-admin on TREE (cpu-demo, relocated)
  local tree=$1; shift
  echo "env KVP_CACHE_ROOT=$DIR/cache-$(basename "$tree") KVP_MODEL_PATH=$tree $PY -m kvpersist.cli $*"
}
state() { echo "$DIR/.kvpersist/cache-$(basename "$1")"; }

files=("$real"/*.safetensors "$real"/*.json)
echo "== first pass: $REAL_GB GiB read (page cache warm after the warm-up run)"
hyperfine -N --warmup 1 --runs "$RUNS" --export-json "$OUT/first.json" \
  --export-markdown "$OUT/first.md" \
  --prepare "rm -f $(state "$real")/weights-digests.json" -n "kvp-admin weights (first pass)" \
  "$(kvp "$real" weights cpu-demo)" \
  --prepare "true" -n "sha256sum" "sha256sum ${files[*]}" \
  --prepare "true" -n "openssl dgst -sha256" "openssl dgst -sha256 ${files[*]}"
echo "-- the same, as paired alternating runs (the ratios docs/benchmarks.md reports)"
"$PY" bench/paired_runs.py --runs "$RUNS" --json "$OUT/first-paired.json" \
  --prepare "kvp-admin weights (first pass)=rm -f $(state "$real")/weights-digests.json" \
  "kvp-admin weights (first pass)=$(kvp "$real" weights cpu-demo)" \
  "sha256sum=sha256sum ${files[*]}" "openssl dgst -sha256=openssl dgst -sha256 ${files[*]}"

for tree in "$real" "$sparse"; do
  name=$(basename "$tree")
  n=$(find "$tree" -maxdepth 1 -type f | wc -l)
  echo "== cached pass: $name ($n files, $(du -sh --apparent-size "$tree" | cut -f1) apparent)"
  eval "$(kvp "$tree" weights cpu-demo)" >/dev/null  # fill the digest cache once
  hyperfine -N --warmup 1 --runs "$RUNS" --export-json "$OUT/cached-$name.json" \
    --export-markdown "$OUT/cached-$name.md" \
    -n "kvp-admin weights (cached)" "$(kvp "$tree" weights cpu-demo)" \
    -n "find -printf (stat per file)" \
    "find $tree -maxdepth 1 -type f -printf '%D %i %s %T@ %C@\\n'" \
    -n "kvp-admin identity namespace" "$(kvp "$tree" identity namespace cpu-demo)"
  echo "-- the same, as paired alternating runs"
  "$PY" bench/paired_runs.py --runs "$RUNS" --json "$OUT/cached-$name-paired.json" \
    "kvp-admin weights (cached)=$(kvp "$tree" weights cpu-demo)" \
    "find -printf=find $tree -maxdepth 1 -type f -printf '%D %i %s %T@ %C@\n'" \
    "kvp-admin identity namespace=$(kvp "$tree" identity namespace cpu-demo)"
  echo "in-process check time (s), 5 runs:"
  for _ in 1 2 3 4 5; do
    eval "$(kvp "$tree" weights cpu-demo --json)" | "$PY" -c \
      'import json,sys; d=json.load(sys.stdin)["current"]; print(d["seconds"], d["sources"])'
  done
done

"$PY" - "$OUT" <<'EOF'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("*.json")):
    if f.stem.endswith("-paired"):
        continue
    res = json.loads(f.read_text())["results"]
    base = statistics.median(res[0]["times"])
    print(f"hyperfine {f.stem}:")
    for r in res:
        med = statistics.median(r["times"])
        print(f"  {r['command'][:40]:40} median {med * 1000:9.1f} ms  "
              f"kvp-admin / this: {base / med:6.2f}x")
EOF
