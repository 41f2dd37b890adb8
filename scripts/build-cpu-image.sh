#!/usr/bin/env bash
# Build, without any registry, the local image that runs vLLM's CPU build in a container:
#
#     scripts/build-cpu-image.sh VENV        # prints the image reference and its id
#
# The image is a minimal Debian bookworm root filesystem made with mmdebstrap from Debian's
# packages (python3.11 and the shared libraries the CPU wheels of torch, vLLM and LMCache's
# connector load), imported with `ENGINE import`. It does NOT carry the ~4 GB of wheels: the
# container runs the host's venv VENV, bind-mounted read-only at the same path (and, when
# VENV's interpreter is not Debian's /usr/bin/python3.11, that interpreter's prefix too;
# `--mounts` prints both, for KVP_CONTAINER_MOUNTS). The image's PATH starts with VENV/bin and
# its entrypoint is `python3 -m vllm.entrypoints.openai.api_server`, as vLLM's own images.
#
# Built once per machine: the tag is a digest of this script, the package list, VENV's path,
# its interpreter and the distributions installed in it (name and version); an image with
# that tag is reused. The image records them in its labels, so the image id (what
# KVP_VLLM_BUILD pins) changes whenever the venv's vLLM or LMCache do.
#
# Environment: KVP_CONTAINER_ENGINE (podman, default, or docker), KVP_IMAGE_NAME (default
# localhost/kvp-vllm-cpu), KVP_DEBIAN_MIRROR (default http://deb.debian.org/debian).
# Output (stdout): `REF ID` (ID is sha256:<64 hex>); with --mounts: the mounts, one a line.
set -euo pipefail
mode=build
if [ "${1:-}" = "--mounts" ]; then mode=mounts; shift; fi
if [ $# -ne 1 ]; then
  echo "usage: $0 [--mounts] VENV" >&2
  exit 2
fi
venv=$(realpath -e -- "$1")
[ -x "$venv/bin/python" ] || { echo "$0: $venv/bin/python not found" >&2; exit 2; }
base=$("$venv/bin/python" -c 'import sys; print(sys.base_prefix)')
mounts=("$venv")
case $base in
  /usr) ;;  # Debian's interpreter: the image has it
  *) mounts+=("$base") ;;
esac
if [ "$mode" = mounts ]; then
  printf '%s\n' "${mounts[@]}"
  exit 0
fi

engine=${KVP_CONTAINER_ENGINE:-podman}
name=${KVP_IMAGE_NAME:-localhost/kvp-vllm-cpu}
mirror=${KVP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# python3.11 for Debian-based venvs; the rest: what torch, vLLM's CPU ops, LMCache's
# connector and a pyenv-built interpreter load (ldd of the venv's extensions); g++ and
# openssl: vLLM's CPU build compiles an op (torch Inductor) at the first request that asks for
# logprobs, as the canary's does; without a compiler its engine dies and the API server exits 0
packages=python3.11,libgomp1,libnuma1,libstdc++6,zlib1g,libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,libreadline8,libncursesw6,libuuid1,libexpat1,libgdbm6,libtirpc3,libnsl2,libcrypt1,procps,g++,openssl
command -v "$engine" >/dev/null || { echo "$0: $engine not found (scripts/setup.sh)" >&2; exit 2; }

# the venv's distributions: name-version of every *.dist-info, sorted
# (kvpersist.system.software.venv_distributions_digest: identity check compares it with the
# venv as it is now)
dists=$(find "$venv"/lib/python3*/site-packages -maxdepth 1 -name '*.dist-info' -printf '%f\n' \
        | LC_ALL=C sort | sha256sum | cut -c1-64)
key=$( { sha256sum <"$0"; echo "$packages $mirror bookworm"; echo "$venv"; echo "$base";
         echo "$dists"; } | sha256sum | cut -c1-16)
ref="$name:$key"
# one build at a time per machine: a second caller (the test suite builds it ahead in the
# background, the container test asks for it) waits, then finds the image built
exec 9>"${TMPDIR:-/tmp}/kvp-build-cpu-image.$(id -u).lock"
flock 9
image_id() { "$engine" image inspect --format '{{.Id}}' "$ref" 2>/dev/null | sed 's/^sha256://'; }
if id=$(image_id) && [ -n "$id" ]; then
  echo "build-cpu-image: $ref exists (id sha256:$id), reused" >&2
  echo "$ref sha256:$id"
  exit 0
fi
command -v mmdebstrap >/dev/null || { echo "$0: mmdebstrap not found (scripts/setup.sh)" >&2; exit 2; }
work=$(mktemp -d /var/tmp/kvp-image.XXXXXX)
trap 'rm -rf -- "$work"' EXIT
start=$(date +%s)
echo "build-cpu-image: mmdebstrap bookworm ($packages)" >&2
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1700000000} mmdebstrap --quiet --variant=essential \
  --include="$packages" --dpkgopt='path-exclude=/usr/share/{doc,man,locale,info}/*' \
  bookworm "$work/rootfs.tar" "$mirror"
path="$venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"$engine" import \
  --change "ENV PATH=$path" \
  --change "ENV VLLM_TARGET_DEVICE=cpu" \
  --change "ENV HF_HUB_OFFLINE=1" \
  --change "LABEL org.kvpersist.venv=$venv" \
  --change "LABEL org.kvpersist.interpreter=$base" \
  --change "LABEL org.kvpersist.venv-dists=sha256:$dists" \
  --change 'ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]' \
  "$work/rootfs.tar" "$ref" >/dev/null
id=$(image_id)
# images of this name built from other inputs are stale: remove them (one in use stays)
"$engine" images --format '{{.Repository}}:{{.Tag}}' "$name" 2>/dev/null | while read -r old; do
  [ "$old" = "$ref" ] || "$engine" rmi "$old" >/dev/null 2>&1 || true
done
echo "build-cpu-image: built $ref (id sha256:$id) in $(( $(date +%s) - start )) s" >&2
echo "$ref sha256:$id"
