#!/usr/bin/env bash
# Start a kvpersist deployment's vLLM in the foreground (systemd, a terminal):
#
#     scripts/run-vllm-with-persist.sh CONFIG [EXTRA VLLM ARGS...]
#
# With KVP_IMAGE set it execs the rendered `docker run` or `podman run`
# (KVP_CONTAINER_ENGINE; the same argv either way): the container named per the config, e.g.
# mimo-pro-tp4-kvp, host network, the weights and KVP_CONTAINER_MOUNTS read-only, nothing of
# the cache root, the state dir, the key or a secret; otherwise it execs vLLM as a
# direct process in the model-link directory, where `--model <namespace>` links to the
# weights, started as the render's vLLM release starts its API server (render JSON
# `vllm.serve`: `vllm serve` for 0.33 and 0.34, the API server module for 0.32; see
# docs/vllm-versions.md). The namespace path stays the same across restarts, so every
# restart finds the files on disk again.
#
# Arguments come from `kvp-admin render CONFIG --json`; identity.env is never sourced. Before
# anything runs, `kvp-admin identity check CONFIG` must find no mismatch. EXTRA VLLM ARGS are
# KV-neutral flags only, checked with the extra arguments by vLLM's own parser.
# Readiness: right before the exec it starts, in the background, `kvp-admin launch CONFIG
# --warmup-only`: once vLLM serves the namespace, it is primed with one short request and the
# warm set is loaded into L1, as `kvp-admin launch` does (`kvp-admin health` says warming
# meanwhile). The systemd unit sets
# KVP_WARMUP=0: its ExecStartPost runs that step, so that the unit turns active after it.
# Environment: KVP_ADMIN (default kvp-admin), KVP_PYTHON (a Python with vLLM; default the
# one next to kvp-admin), KVP_VLLM_PID_FILE (write the pid, which exec keeps), KVP_WARMUP (0:
# no warm-up step here), KVP_READY_DEADLINE (seconds for vLLM's start and the warm-up,
# default 1800).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 CONFIG [EXTRA VLLM ARGS...]" >&2
  exit 2
fi
config=$1; shift
# the working directory changes below: a relative config path is made absolute
if [ -e "$config" ] && [ "${config#/}" = "$config" ]; then config=$(realpath -- "$config"); fi
admin=${KVP_ADMIN:-kvp-admin}
admin_path=$(command -v "$admin") || { echo "$0: $admin not found (set KVP_ADMIN)" >&2; exit 2; }
py=${KVP_PYTHON:-$(dirname "$admin_path")/python}
[ -x "$py" ] || py=python3

# Refuse when the identity does not describe what would run (the weights at KVP_MODEL_PATH,
# the installed lmcache and vLLM, the image): every mismatch is listed, exit 2.
if ! check=$("$admin" identity check "$config" 2>&1); then
  printf '%s\n' "$check" >&2
  echo "run-vllm-with-persist: the identity of $config does not describe what would run;" \
       "refusing (kvp-admin identity check $config)" >&2
  exit 2
fi
render=$("$admin" render "$config" --json)
# The weights at KVP_MODEL_PATH must be those the namespace was first served with (they are
# recorded now if it never was): refused as `kvp-admin launch` refuses, exit 2.
"$admin" weights "$config" --record >&2 || {
  echo "run-vllm-with-persist: not starting vLLM for $config (see above)" >&2; exit 2; }
field() {  # field NAME: one value of the render JSON, NUL-separated if a list
  "$py" -c '
import json, sys
v = json.loads(sys.stdin.read())
for k in sys.argv[1].split("."):
    v = v[k]
if isinstance(v, list):
    sys.stdout.write("".join(str(a) + "\0" for a in v))
else:
    sys.stdout.write(str(v))' "$1" <<<"$render"
}
# What the deployment's device needs in vLLM's environment (render JSON `vllm.env`: the CPU
# build's KV cache size and device, HF_HUB_OFFLINE, for KVP_DEVICE=cpu; nothing for a GPU);
# a value the caller set is kept.
while IFS= read -r -d '' kv; do
  name=${kv%%=*}
  [ -n "${!name:-}" ] || export "$kv"
done < <(field vllm.env)
# vLLM's own parser reads the extra and engine arguments (and ARGS) before vLLM starts: only
# KV-neutral flags outside KVP_ENGINE_ARGS (docs/engine-flags.md). It runs in the environment
# vLLM will run in.
"$py" -m kvpersist.stack.vllm_args "$config" "$@" <<<"$render" || exit 2
ready_step() {  # the warm-up once vLLM serves; a double fork, so nobody has to reap it
  # Exit 3 is a failed canary (docs/canary.md): vLLM must not go on serving from that cache
  # path, so the step stops it (this script's pid is vLLM's, or the container client's,
  # after the exec below); its next start renders it without the cache connector.
  if [ "${KVP_WARMUP:-1}" != "0" ]; then
    local main=$$
    ( ( "$admin" launch "$config" --warmup-only --deadline "${KVP_READY_DEADLINE:-1800}" \
          </dev/null >/dev/null 2>&1
        [ $? -ne 3 ] || kill -TERM "$main" ) & )
  fi
}
mapfile -d '' container < <(field container_argv)
if [ ${#container[@]} -gt 0 ]; then
  command -v "${container[0]}" >/dev/null || {
    echo "run-vllm-with-persist: ${container[0]} not found (KVP_CONTAINER_ENGINE)" >&2; exit 2; }
  echo "run-vllm-with-persist: exec ${container[*]:0:5} ..." >&2
  if [ -n "${KVP_VLLM_PID_FILE:-}" ]; then
    echo $$ >"$KVP_VLLM_PID_FILE"
  fi
  ready_step
  exec "${container[@]}" "$@"
fi
mapfile -d '' vllm_args < <(field vllm_argv)
mapfile -d '' serve < <(field vllm.serve)
link_dir=$(field model_link.dir)
link_name=$(field model_link.name)
link_target=$(field model_link.target)
mkdir -p -m 0700 "$link_dir"
ln -sfn "$(realpath "$link_target")" "$link_dir/$link_name"
cd "$link_dir"
if [ -n "${KVP_VLLM_PID_FILE:-}" ]; then
  echo $$ >"$KVP_VLLM_PID_FILE"
fi
umask 077
echo "run-vllm-with-persist: vLLM ${serve[*]:1} for namespace $link_name in $link_dir" >&2
ready_step
# torch inductor's compiled kernels (the CPU build compiles its logprobs op at the first
# request for logprobs: the canary's): with XDG_CACHE_HOME set (the vLLM unit's
# CacheDirectory=) they are kept there instead of in /tmp, which the unit's PrivateTmp= makes
# new at every start. For vLLM's process only: the readiness step above may run as another
# user, which cannot enter that directory.
if [ -n "${XDG_CACHE_HOME:-}" ] && [ -z "${TORCHINDUCTOR_CACHE_DIR:-}" ]; then
  export TORCHINDUCTOR_CACHE_DIR="$XDG_CACHE_HOME/torchinductor"
fi
exec "$py" "${serve[@]}" "${vllm_args[@]}" "$@"
