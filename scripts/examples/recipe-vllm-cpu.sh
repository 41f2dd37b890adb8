#!/usr/bin/env bash
# A sample production recipe: starts vLLM (CPU build here) with its own flags. The two
# kvpersist lines make it persistent when run with KV_PERSIST=1 KVP_CONFIG=<config>; without
# KV_PERSIST=1 the command below runs exactly as written.
#
# Usage: MODEL_DIR=/path/to/weights PORT=8010 [KV_PERSIST=1 KVP_CONFIG=cpu-demo] recipe-vllm-cpu.sh
# RECIPE_DRY_RUN=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail
MODEL_DIR=${MODEL_DIR:?set MODEL_DIR}
PORT=${PORT:-8010}
PYTHON=${PYTHON:-python3}

VLLM_CMD=("$PYTHON" -m vllm.entrypoints.openai.api_server
          --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT"
          --dtype bfloat16 --enforce-eager --max-model-len 4096 --block-size 128)

# --- kvpersist (no effect unless KV_PERSIST=1) ---
source "$(dirname "$0")/../kv-persist-hook.sh"
kvp_persist_apply VLLM_CMD
# ---

if [ "${RECIPE_DRY_RUN:-0}" = 1 ]; then
  printf '%s\0' "${VLLM_CMD[@]}"
  exit 0
fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1
exec "${VLLM_CMD[@]}"
