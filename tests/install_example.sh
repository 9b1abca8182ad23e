#!/usr/bin/env bash
# Installs the built deepnex into a temporary prefix, builds
# examples/cpp_trainer against it with find_package(deepnex), and runs it.
# Usage: install_example.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src/examples/cpp_trainer" -B "$work/trainer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/trainer" >/dev/null
LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}" "$work/trainer/cpp_trainer" --workers 2 --steps 200
