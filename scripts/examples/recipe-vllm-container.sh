#!/usr/bin/env bash
# A sample production recipe that runs vLLM in its own container (`podman run` or `docker
# run`, same argv), with its own container name, image and flags. The two kvpersist lines make
# it persistent when run with KV_PERSIST=1 KVP_CONFIG=<config>: the hook rewrites the vLLM
# command (the namespace as the model, the public name, the cache server's
# --kv-transfer-config) and adds to the run options the weights' mount at /kvp-models/<ns>
# and the working directory; without KV_PERSIST=1 both arrays run exactly as written.
#
# Usage: MODEL_DIR=/path/to/weights IMAGE=ref [ENGINE=podman] [NAME=recipe-vllm] [PORT=8010]
#        [MOUNTS="/venv /python-prefix"] [KV_PERSIST=1 KVP_CONFIG=cfg] recipe-vllm-container.sh
# MOUNTS: host paths the image needs read-only at the same path (the image of
# scripts/build-cpu-image.sh runs the host's venv). The weights are mounted at their own path,
# so --model is the same path inside the container as KVP_MODEL_PATH on the host.
# RECIPE_DRY_RUN=1 prints the final command (NUL-separated) instead of running it.
set -euo pipefail
MODEL_DIR=${MODEL_DIR:?set MODEL_DIR}
IMAGE=${IMAGE:?set IMAGE}
ENGINE=${ENGINE:-podman}
NAME=${NAME:-recipe-vllm}
PORT=${PORT:-8010}

RUN_OPTS=(--rm --name "$NAME" --network host --shm-size=1g -v "$MODEL_DIR:$MODEL_DIR:ro"
          --env VLLM_CPU_KVCACHE_SPACE=1 --env HF_HUB_OFFLINE=1)
for m in ${MOUNTS:-}; do RUN_OPTS+=(-v "$m:$m:ro"); done
VLLM_CMD=(python3 -m vllm.entrypoints.openai.api_server
          --model "$MODEL_DIR" --host 127.0.0.1 --port "$PORT"
          --dtype bfloat16 --enforce-eager --max-model-len 4096 --block-size 128)

# --- kvpersist (no effect unless KV_PERSIST=1) ---
source "$(dirname "$0")/../kv-persist-hook.sh"
kvp_persist_apply VLLM_CMD RUN_OPTS
# ---

CMD=("$ENGINE" run "${RUN_OPTS[@]}" --entrypoint "${VLLM_CMD[0]}" "$IMAGE" "${VLLM_CMD[@]:1}")
if [ "${RECIPE_DRY_RUN:-0}" = 1 ]; then
  printf '%s\0' "${CMD[@]}"
  exit 0
fi
exec "${CMD[@]}"
