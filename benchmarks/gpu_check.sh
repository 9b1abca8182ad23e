#!/usr/bin/env bash
# On a machine with a GPU: the checks that need one, in a few minutes.
#  1. collective_gpu_test: the nccl backend's C++ tests and its busbw sweep
#     (1 KiB..256 MiB, one rank per visible GPU);
#  2. tests/python/test_gpu_device.py and the CUDA test of test_collective.py:
#     NVML discovery against CUDA, the shared-mode memory limit in PyTorch,
#     a process container's GPU device rules and NVML usage, an agent's GPU
#     node, CUDA tensors through nccl, DDP and the parameter server;
#  3. benchmarks/nccl_bench: deepnex's nccl allreduce and allgather beside
#     torch's.
# Without a GPU every test skips with its reason. The container tests need
# cgroups: on cgroup v2, run it as root from the root cgroup (`echo $$ >
# /sys/fs/cgroup/cgroup.procs` first), as the process backend asks there.
#
#   bash benchmarks/gpu_check.sh
#
# BUILD: the build directory (default build-gpu-check). Where it already
# holds bin/collective_gpu_test (a build made on another machine, copied
# with its libraries on LD_LIBRARY_PATH) it is used as it is; otherwise it
# is configured and built with NCCL (CUDA + NCCL at /usr/local/cuda).
# PYTHON: the interpreter with PyTorch (default /usr/bin/python3).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-$root/build-gpu-check}
export PYTHON=${PYTHON:-/usr/bin/python3}
command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "gpu_check: no nvidia-smi"
if [[ ! -x "$BUILD/bin/collective_gpu_test" ]]; then
  cmake -S "$root" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DDEEPNEX_WITH_NCCL=ON -DPython_EXECUTABLE="$PYTHON" >/dev/null || exit 1
  cmake --build "$BUILD" -j"$(nproc)" || exit 1
fi
failed=()
echo "== nccl backend (C++)"
timeout 300 "$BUILD/bin/collective_gpu_test" || failed+=(collective_gpu_test)
echo "== GPU tests (Python)"
(cd "$root" && PYTHONPATH="$BUILD/python" DEEPNEX_BUILD_DIR="$BUILD" timeout 600 \
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/python/test_gpu_device.py \
  "tests/python/test_collective.py::test_auto_backend_sends_host_arrays_through_cpu_and_cuda_tensors_through_nccl") \
  || failed+=(test_gpu_device)
echo "== nccl_bench"
if "$PYTHON" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  for op in allreduce allgather; do
    PYTHONPATH="$BUILD/python" timeout 300 "$PYTHON" "$root/benchmarks/nccl_bench" --op $op \
      || failed+=("nccl_bench --op $op")
  done
else
  echo "nccl_bench: skipped, PyTorch sees no CUDA device"
fi
if (( ${#failed[@]} )); then
  echo "gpu_check: FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu_check: all passed or skipped"
