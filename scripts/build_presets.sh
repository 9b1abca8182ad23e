#!/usr/bin/env bash
# Builds deepnex's preset images from Debian packages with mmdebstrap, each
# as an OCI image layout (tag "latest") that an admin adds to
# deepnex-central's catalog, which pushes it to the site's --registry:
#
#   scripts/build_presets.sh OUT_DIR [debian-python] [debian-torch]
#   deepnex image register debian-python OUT_DIR/debian-python --token-file admin.tok
#
# Default: both presets. SUITE (default bookworm) and MIRROR (default
# mmdebstrap's, deb.debian.org) pick the packages. Needs root (the files'
# owners are kept), mmdebstrap and umoci (scripts/setup.sh installs them).
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 OUT_DIR [debian-python] [debian-torch]" >&2
  exit 2
fi
out=$(realpath -m "$1")
shift
presets=("$@")
[[ ${#presets[@]} -gt 0 ]] || presets=(debian-python debian-torch)
if [[ $(id -u) -ne 0 ]]; then
  echo "$0: needs root: the images' files keep their owners" >&2
  exit 1
fi
for tool in mmdebstrap umoci; do
  command -v "$tool" >/dev/null || { echo "$0: $tool is missing (scripts/setup.sh)" >&2; exit 1; }
done
suite=${SUITE:-bookworm}
mirror=(${MIRROR:-})

declare -A packages=(
  [debian-python]="python3 python3-numpy python3-pip ca-certificates"
  [debian-torch]="python3 python3-numpy python3-pip python3-torch ca-certificates"
)

mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for name in "${presets[@]}"; do
  if [[ -z "${packages[$name]:-}" ]]; then
    echo "$0: \"$name\" is not a preset (${!packages[*]})" >&2
    exit 2
  fi
  layout="$out/$name"
  if [[ -e "$layout" ]]; then
    echo "$0: $layout exists; remove it to build $name again" >&2
    exit 1
  fi
  echo "building $name: ${packages[$name]} from Debian $suite" >&2
  # apt's variant: a minimal system that can still install packages, with
  # apt's caches and lists dropped from the image.
  mmdebstrap --quiet --mode=root --variant=apt --format=tar \
    --include="${packages[$name]// /,}" \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    "$suite" "$work/$name.tar" "${mirror[@]}"
  umoci init --layout "$layout"
  umoci new --image "$layout:latest"
  umoci unpack --image "$layout:latest" "$work/$name.bundle" >/dev/null
  tar -xf "$work/$name.tar" -C "$work/$name.bundle/rootfs"
  umoci repack --image "$layout:latest" "$work/$name.bundle"
  umoci config --image "$layout:latest" --config.cmd python3 \
    --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  umoci gc --layout "$layout"
  rm -rf "$work/$name.bundle" "$work/$name.tar"
  echo "$layout" >&2
done
