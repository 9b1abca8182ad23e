#!/usr/bin/env bash
# Installs the built deepnex into a temporary prefix, builds
# examples/cpp_trainer against it with find_package(deepnex) and with
# pkg-config, and runs it; first it checks that each installed header
# compiles alone and that libdeepnex exports only its own symbols.
# Usage: install_example.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
export PKG_CONFIG_PATH="$(dirname "$(find "$work/prefix" -name deepnex.pc)")"
libdir=$(pkg-config --variable=libdir deepnex)
# Each installed header compiles alone, with the flags pkg-config gives (no
# header it includes is missing from the prefix), warning-free in C++17 and 20.
for h in $(cd "$work/prefix/include" && find deepnex -name '*.h' | sort); do
  for std in c++17 c++20; do
    echo "#include \"$h\"" | g++ -x c++ -std=$std -Wall -Wextra -Werror -fsyntax-only \
      $(pkg-config --cflags deepnex) - || { echo "$h does not compile alone ($std)"; exit 1; }
  done
done
# libdeepnex exports its own symbols only (src/deepnex.map): not its copies
# of the gRPC, protobuf, abseil, JSON and YAML code a trainer may have in
# another version.
foreign=$(nm -D --defined-only "$libdir/libdeepnex.so" | awk '{print $3}' |
          grep -v deepnex | c++filt || true)
if [[ -n $foreign ]]; then
  echo "libdeepnex exports $(wc -l <<<"$foreign") symbols not its own, e.g.:"
  head -5 <<<"$foreign"
  exit 1
fi
cmake -S "$src/examples/cpp_trainer" -B "$work/trainer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/trainer" >/dev/null
LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}" "$work/trainer/cpp_trainer" --workers 2 --steps 200
# Without CMake: the flags pkg-config gives are all a plain compiler needs.
bash -c 'g++ -O1 "$0" -o "$1" $(pkg-config --cflags --libs deepnex)' \
  "$src/examples/cpp_trainer/trainer.cc" "$work/trainer-pc"
LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}" "$work/trainer-pc" --workers 2 --steps 50
# A bad flag is a usage error, not an abort (--workers -1 was a
# std::length_error, --workers 0 with --server a segfault).
out=$(LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}" "$work/trainer-pc" \
      --workers 0 --server 127.0.0.1:1 2>&1) && rc=0 || rc=$?
[[ $rc == 2 && $out == 'cpp_trainer: --workers "0": must be a number in 1..65536' ]] ||
  { echo "cpp_trainer --workers 0: exit $rc: $out"; exit 1; }
