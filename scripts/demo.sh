#!/usr/bin/env bash
# The main job on the embedded default: builds deepnex and trains a small
# model through a parameter server with 2 worker processes, sync then async.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHON=${PYTHON:-/usr/bin/python3}
export BUILD=${BUILD:-$root/build}
bash "$root/scripts/setup.sh"
echo "building deepnex (first time: a few minutes on 2 cores)..."
bash "$root/scripts/build.sh" _C deepnex-ps deepnex_python_files >/dev/null
PYTHONPATH="$BUILD/python" exec "$PYTHON" "$root/examples/ps_demo.py" "$@"
