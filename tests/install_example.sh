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
# Without CMake: the flags pkg-config gives are all a plain compiler needs.
PKG_CONFIG_PATH="$(dirname "$(find "$work/prefix" -name deepnex.pc)")" \
  bash -c 'g++ -O1 "$0" -o "$1" $(pkg-config --cflags --libs deepnex)' \
  "$src/examples/cpp_trainer/trainer.cc" "$work/trainer-pc"
LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}" "$work/trainer-pc" --workers 2 --steps 50
