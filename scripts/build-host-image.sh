#!/usr/bin/env bash
# Build, without any registry, the local image of a test HOST: a Debian bookworm root
# filesystem whose PID 1 is systemd, with sshd, so that the deployment tests
# (tests/deploy/test_hosts_*.py) run the Ansible role over SSH and the units under the real
# systemd 252, each host a podman container:
#
#     scripts/build-host-image.sh            # prints the image reference and its id
#
# The root filesystem is made with mmdebstrap (variant minbase) from Debian's packages:
# systemd and systemd-sysv (PID 1), dbus, openssh-server, python3 (Ansible's modules and the
# interpreter the hosts run kvpersist with), iproute2 and procps (ss, ps for testinfra),
# e2fsprogs (fsck of the NVMe stand-in at boot), the shared libraries the CPU wheels of
# torch and vLLM load (libgomp1, libnuma1), g++ and openssl: vLLM's CPU build compiles its
# logprobs op with torch.compile (Inductor's C++ backend, which also runs the openssl
# command) at the first request that asks for logprobs (the canary's), and without them its
# engine dies there (InvalidCxxCompiler, then "No such file or directory: 'openssl'") and
# the API server exits 0 (seen on these hosts). It carries no kvpersist, LMCache or vLLM: the
# tests bind-mount the project's venv read-only into each host (the image's python3.11 runs
# it; see tests/deploy/_hosts.py). Two changes to the packages' defaults, both for hosts
# made from one image: no SSH host keys in the image (each host makes its own at its first
# boot, kvp-host-keys.service) and an empty /etc/machine-id (each host gets its own).
#
# Built once per machine: the tag is a digest of this script, the package list and the
# mirror; an image with that tag is reused, images of this name built from other inputs are
# removed. Run as root (podman as root: the hosts need systemd, mounts and network
# namespaces).
#
# Environment: KVP_HOST_IMAGE_NAME (default localhost/kvp-host), KVP_DEBIAN_MIRROR (default
# http://deb.debian.org/debian). Output (stdout): `REF ID` (ID is sha256:<64 hex>).
set -euo pipefail
if [ $# -ne 0 ]; then
  echo "usage: $0" >&2
  exit 2
fi
name=${KVP_HOST_IMAGE_NAME:-localhost/kvp-host}
mirror=${KVP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
packages=systemd,systemd-sysv,dbus,openssh-server,python3,iproute2,procps,e2fsprogs,libgomp1,libnuma1,g++,openssl
command -v podman >/dev/null || { echo "$0: podman not found (scripts/setup.sh)" >&2; exit 2; }
key=$( { sha256sum <"$0"; echo "$packages $mirror bookworm"; } | sha256sum | cut -c1-16)
ref="$name:$key"
# one build at a time per machine: scripts/test.sh builds it ahead in the background and the
# tests ask for it; a second caller waits, then finds the image built
exec 9>"${TMPDIR:-/tmp}/kvp-build-host-image.$(id -u).lock"
flock 9
image_id() { podman image inspect --format '{{.Id}}' "$ref" 2>/dev/null | sed 's/^sha256://'; }
if id=$(image_id) && [ -n "$id" ]; then
  echo "build-host-image: $ref exists (id sha256:$id), reused" >&2
  echo "$ref sha256:$id"
  exit 0
fi
command -v mmdebstrap >/dev/null || { echo "$0: mmdebstrap not found (scripts/setup.sh)" >&2; exit 2; }
work=$(mktemp -d /var/tmp/kvp-host-image.XXXXXX)
trap 'rm -rf -- "$work"' EXIT
start=$(date +%s)
echo "build-host-image: mmdebstrap bookworm ($packages)" >&2
# Each host makes its own SSH host keys at its first boot (before sshd); the image has none.
keys_unit='[Unit]
Description=SSH host keys of this host (made at its first boot)
Before=ssh.service
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A

[Install]
WantedBy=multi-user.target'
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1700000000} mmdebstrap --quiet --variant=minbase \
  --include="$packages" --dpkgopt='path-exclude=/usr/share/{doc,man,locale,info}/*' \
  --customize-hook='rm -f "$1"/etc/ssh/ssh_host_*' \
  --customize-hook="printf '%s\n' '$keys_unit' > \"\$1/etc/systemd/system/kvp-host-keys.service\"" \
  --customize-hook='ln -s /etc/systemd/system/kvp-host-keys.service "$1/etc/systemd/system/multi-user.target.wants/kvp-host-keys.service"' \
  --customize-hook='printf "PasswordAuthentication no\nPermitRootLogin prohibit-password\n" > "$1/etc/ssh/sshd_config.d/kvp-host.conf"' \
  --customize-hook=': > "$1/etc/machine-id"' \
  bookworm "$work/rootfs.tar" "$mirror"
podman import \
  --change 'CMD ["/sbin/init"]' \
  --change "LABEL org.kvpersist.host-image=$key" \
  "$work/rootfs.tar" "$ref" >/dev/null
id=$(image_id)
# images of this name built from other inputs are stale: remove them (one in use stays)
podman images --format '{{.Repository}}:{{.Tag}}' "$name" 2>/dev/null | while read -r old; do
  [ "$old" = "$ref" ] || podman rmi "$old" >/dev/null 2>&1 || true
done
echo "build-host-image: built $ref (id sha256:$id) in $(( $(date +%s) - start )) s" >&2
echo "$ref sha256:$id"
