#!/usr/bin/env bash
# On a machine with a GPU (and CUDA + NCCL at /usr/local/cuda): builds
# deepnex with NCCL, runs every CTest test labelled `gpu` and the nccl
# allreduce busbw sweep (1 KiB..256 MiB, one rank per visible GPU), in under
# 5 minutes. Without a GPU the gpu tests skip with a message.
#
#   bash benchmarks/gpu_check.sh          # BUILD=... to choose the build dir
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-$root/build-gpu-check}
export PYTHON=${PYTHON:-/usr/bin/python3}
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "gpu_check: no nvidia-smi"
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
  cmake -S "$root" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DDEEPNEX_WITH_NCCL=ON -DDEEPNEX_BUILD_PYTHON=OFF \
    -DPython_EXECUTABLE="$PYTHON" >/dev/null
fi
cmake --build "$BUILD" -j"$(nproc)" --target collective_gpu_test
cmake --build "$BUILD" -j"$(nproc)"
cd "$BUILD"
echo "== gpu-labelled tests"
status=0
ctest -L gpu --output-on-failure --timeout 300 -V > gpu_check.log 2>&1 || status=$?
grep -E "nccl allreduce|Test +#|tests passed|SKIPPED|Skipped|FAILED|Failure" gpu_check.log || true
if [[ $status -ne 0 ]]; then
  echo "gpu_check: gpu tests FAILED (full log: $BUILD/gpu_check.log)"
  exit 1
fi
echo "gpu_check: all gpu tests passed or skipped (full log: $BUILD/gpu_check.log)"
