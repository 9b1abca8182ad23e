#!/usr/bin/env bash
# Configures and builds deepnex into $BUILD (default: build). Extra arguments
# are CMake targets to build (default: everything).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-/usr/bin/python3}
BUILD=${BUILD:-$root/build}
# ccache keys on paths relative to the repository, so clones (CI's among
# them) share a cache; without NOHASHDIR the build directory's own path is
# hashed (it is in the debug info), and no clone ever hits.
export CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=true
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  cmake -S "$root" -B "$BUILD" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DPython_EXECUTABLE="$PYTHON" -DPYTHON_EXECUTABLE="$PYTHON" >/dev/null
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$BUILD" -j2 "${targets[@]}"
