# shellcheck shell=bash
# kvpersist hook for an existing vLLM production recipe. Source it, then call
#
#     kvp_persist_apply ARRAY_NAME [CONTAINER_OPTS_ARRAY_NAME]
#
# on the bash array that holds the recipe's vLLM command, right before the recipe runs it.
# A recipe that runs vLLM in its own container (`docker run`/`podman run` OPTS IMAGE CMD)
# passes the array of its run options too: the hook then appends the mount that makes the
# namespace resolve inside the container (the weights, read-only, at /kvp-models/<namespace>)
# and the working directory (-w /kvp-models), as the rendered KVP_IMAGE container has them.
# The recipe keeps its own name, image and mounts; it needs the host network (--network host)
# to reach the cache server on loopback, and must mount nothing of the cache root, the state
# dir, the key or a secret (the hook refuses a -v/--volume/--mount source that holds or lies
# in one of them). Its --model is the weights' path inside the container, which must be the
# same path as KVP_MODEL_PATH on the host (mount them at the same path).
#
# * Without KV_PERSIST=1 this does nothing: the command stays byte-for-byte unchanged.
# * With KV_PERSIST=1 (and KVP_CONFIG naming the deployment) it checks that the deployment's
#   identity describes what will run (`kvp-admin identity check`: the weights at
#   KVP_MODEL_PATH, the installed lmcache and vLLM; a mismatch refuses, return 2), checks the
#   weights against the namespace's record (`kvp-admin weights CONFIG --record`: weights that
#   changed since the namespace was first served refuse, return 2), makes sure the
#   deployment's lmcache server is up and healthy (`kvp-admin launch CONFIG --no-vllm` when it
#   is not; after an unclean stop of the server that launch first verifies the chunk files
#   written since its last start and quarantines those that fail, as `kvp-admin launch` and
#   the systemd unit do),
#   then rewrites the array with exactly the persistence arguments (`kvpersist/deploy/hook.py`):
#   the model argument becomes the namespace (linked to the weights in the deployment's
#   model-link directory, which becomes the working directory), --served-model-name keeps
#   the public name, --kv-transfer-config points at the cache server. Last, it starts the
#   readiness step in the background (`kvp-admin launch CONFIG --warmup-only`, detached: it
#   outlives the recipe's `exec`): once the recipe's vLLM serves the namespace (it has
#   registered with the cache server), the warm set is loaded into L1 (bounded by
#   KVP_WARMUP_WAIT), as `kvp-admin launch` does; `kvp-admin health` says warming (exit 3)
#   meanwhile and healthy after. A warm-up that fails leaves vLLM serving, cold (degraded).
#
# It never sources identity.env: everything comes from `kvp-admin render CONFIG --json`.
# Environment: KV_PERSIST (1 to enable), KVP_CONFIG (required then), KVP_ADMIN (default:
# kvp-admin on PATH), KVP_PYTHON (a Python with kvpersist; default: the one next to
# kvp-admin), KVP_HOOK_TIMEOUT (seconds to wait for the server, default 60), KVP_WARMUP (0:
# no warm-up step), KVP_READY_DEADLINE (seconds for vLLM's start and the warm-up together,
# default 1800).

kvp_persist_apply() {
  local __name=$1
  if [ "${KV_PERSIST:-0}" != "1" ]; then
    return 0
  fi
  if [ -z "${KVP_CONFIG:-}" ]; then
    echo "kv-persist-hook: KV_PERSIST=1 needs KVP_CONFIG (a kvpersist deployment config)" >&2
    return 2
  fi
  local admin=${KVP_ADMIN:-kvp-admin}
  local admin_path py
  admin_path=$(command -v "$admin") || {
    echo "kv-persist-hook: $admin not found (set KVP_ADMIN)" >&2; return 2; }
  py=${KVP_PYTHON:-$(dirname "$admin_path")/python}
  [ -x "$py" ] || py=python3

  # The identity must describe what the recipe is about to run: the weights at
  # KVP_MODEL_PATH and this host's lmcache and vLLM. A mismatch refuses before anything
  # starts (exit 2), listing every mismatched key.
  local check_out
  if ! check_out=$("$admin" identity check "$KVP_CONFIG" 2>&1); then
    printf '%s\n' "$check_out" >&2
    echo "kv-persist-hook: the identity of $KVP_CONFIG does not describe what would run;" \
         "refusing (kvp-admin identity check $KVP_CONFIG)" >&2
    return 2
  fi

  # The weights at KVP_MODEL_PATH must be those the namespace was first served with (they
  # are recorded now if it never was): refused as `kvp-admin launch` refuses, exit 2.
  if ! "$admin" weights "$KVP_CONFIG" --record >&2; then
    echo "kv-persist-hook: not starting vLLM for $KVP_CONFIG (see above)" >&2
    return 2
  fi

  # The cache server: healthy already, or launch it (a concurrent launch is fine: the
  # second one is refused and we wait for health). The launch checks the crash window
  # first when the server's last stop was unclean (bounded: 60 s).
  if ! "$admin" health "$KVP_CONFIG" --no-vllm >/dev/null 2>&1; then
    echo "kv-persist-hook: starting the cache server for $KVP_CONFIG" >&2
    "$admin" launch "$KVP_CONFIG" --no-vllm >&2 || true
    "$admin" health "$KVP_CONFIG" --no-vllm --wait "${KVP_HOOK_TIMEOUT:-60}" >/dev/null || {
      echo "kv-persist-hook: the cache server of $KVP_CONFIG is not healthy" >&2
      "$admin" health "$KVP_CONFIG" --no-vllm >&2 || true
      return 1; }
  fi

  local render_file rc
  render_file=$(mktemp) || return 1
  if ! "$admin" render "$KVP_CONFIG" --json >"$render_file"; then
    rm -f "$render_file"; return 2
  fi
  local -n __cmd=$__name
  local -a __new=()
  mapfile -d '' __new < <("$py" -m kvpersist.deploy.hook "$render_file" -- "${__cmd[@]}"; \
                           echo -n "$?" >"$render_file.rc")
  rc=$(cat "$render_file.rc" 2>/dev/null || echo 1)
  local link_dir link_name link_target
  { read -r link_dir; read -r link_name; read -r link_target; } < <("$py" -c '
import json, sys
link = json.load(open(sys.argv[1]))["model_link"]
print(link["dir"]); print(link["name"]); print(link["target"])' "$render_file")
  rm -f "$render_file" "$render_file.rc"
  if [ "$rc" != "0" ]; then
    return "$rc"
  fi
  mkdir -p -m 0700 "$link_dir" || return 1
  ln -sfn "$(realpath "$link_target")" "$link_dir/$link_name" || return 1
  cd "$link_dir" || return 1
  __cmd=("${__new[@]}")
  if [ -n "${2:-}" ]; then
    # the recipe's container: the weights at /kvp-models/<namespace> (render.py's
    # CONTAINER_MODEL_DIR), the working directory there; its own mounts checked first
    local -n __opts=$2
    "$py" -m kvpersist.deploy.hook_container "$KVP_CONFIG" -- "${__opts[@]}" || return 2
    __opts+=(-v "$(realpath "$link_target"):/kvp-models/$link_name:ro" -w /kvp-models)
    echo "kv-persist-hook: persistence on in the recipe's container (namespace $link_name" \
         "at /kvp-models)" >&2
  else
    echo "kv-persist-hook: persistence on (namespace $link_name, working directory $link_dir)" >&2
  fi
  if [ "${KVP_WARMUP:-1}" != "0" ]; then
    # a double fork: the step is nobody's child once the recipe execs vLLM; a relative
    # config path is made absolute (the working directory changed above)
    local cfg_abs
    cfg_abs=$(realpath -e -- "$OLDPWD/$KVP_CONFIG" 2>/dev/null) || cfg_abs=$KVP_CONFIG
    case $KVP_CONFIG in /*) cfg_abs=$KVP_CONFIG ;; esac
    ( "$admin" launch "$cfg_abs" --warmup-only --deadline "${KVP_READY_DEADLINE:-1800}" \
        </dev/null >/dev/null 2>&1 & )
    echo "kv-persist-hook: the priming request and the warm-up follow once vLLM serves" \
         "(kvp-admin health says warming until the warm-up is done)" >&2
  fi
}
