#!/usr/bin/env bash
# The main job on the embedded default: builds deepnex, then `deepnex run`
# trains the digits MLP (examples/digits/mlp_numpy.py) with 2 workers and a
# parameter server in sync mode, on a local allocator over this machine and
# the process backend, printing loss and test accuracy per epoch and a
# summary. Extra arguments go to the training script (e.g. --epochs 20).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHON=${PYTHON:-/usr/bin/python3}
export BUILD=${BUILD:-$root/build}
bash "$root/scripts/setup.sh"
echo "building deepnex (first time: a few minutes on 2 cores)..."
bash "$root/scripts/build.sh" _C deepnex-ps deepnex_python_files >/dev/null
export PYTHONPATH="$BUILD/python" DEEPNEX_BUILD_DIR="$BUILD"
exec "$PYTHON" -m deepnex run --workers 2 --mode sync --optimizer sgd --lr 0.1 --momentum 0.9 \
  -- "$PYTHON" "$root/examples/digits/mlp_numpy.py" "$@"
