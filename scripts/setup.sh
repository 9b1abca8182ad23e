#!/usr/bin/env bash
# Installs every system package deepnex needs to build, test and benchmark.
# Idempotent: when everything is present it only runs dpkg-query and exits.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git ccache
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libssl-dev libcurl4-openssl-dev nlohmann-json3-dev libyaml-cpp-dev
  libgtest-dev libgmock-dev
  pybind11-dev python3-dev python3-numpy python3-pytest python3-venv python3-pip
  python3-setuptools python3-wheel
  python3-torch python3-sklearn python3-matplotlib
  # deepnex tune's model-based search (Optuna's samplers)
  python3-optuna python3-cmaes
  # launch backends, each driven for real by the tests (see ENGINES.md)
  runc tini podman busybox-static
  # the image catalog: a site's OCI registry, and moving images to and from it
  docker-registry skopeo umoci
  # scripts/build_presets.sh: the preset images from Debian packages
  mmdebstrap
  slurmctld slurmd slurm-client munge
  # simulated hosts for the cross-host tests (tests/python/_hosts.py)
  iproute2 iptables util-linux
  python3-kubernetes python3-yaml
  # deepnex notebook and its tests (the REST API, a kernel's websocket, a screenshot)
  jupyter-notebook python3-websocket chromium
  # peers for the benchmarks
  openmpi-bin libopenmpi-dev
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

echo "setup: installing ${missing[*]}" >&2
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
