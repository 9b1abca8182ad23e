#!/usr/bin/env bash
# Installs what is needed, builds, and runs every test: the C++ suites
# (ctest), the Python suites (pytest) from the build tree, and the same
# Python suites against the package installed with pip into a venv.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export PYTHON=${PYTHON:-/usr/bin/python3}
export BUILD=${BUILD:-$root/build}

bash scripts/setup.sh
bash scripts/build.sh

echo "== C++ tests (ctest)"
(cd "$BUILD" && ctest --output-on-failure -j2 --timeout 900)

echo "== Python tests (build tree)"
export DEEPNEX_BUILD_DIR=$BUILD
PYTHONPATH="$BUILD/python" "$PYTHON" -m pytest -q -p no:cacheprovider tests/python

echo "== Python package: pip install into a venv, then the Python tests again"
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
# Readable by everyone, as an install on a real node is: the tests' users'
# containers (jobs on agent nodes included) run as nobody, and run this
# venv's python and the package's deepnex-ps.
chmod 755 "$venv"
"$PYTHON" -m venv --system-site-packages "$venv"
CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=true "$venv/bin/python" -m pip install -q --no-build-isolation --no-index "$root"
(cd "$venv" && "$venv/bin/python" -c 'import deepnex, sys; assert deepnex.__file__.startswith(sys.prefix), deepnex.__file__')
(cd "$venv" && "$venv/bin/python" -m pytest -q -p no:cacheprovider "$root/tests/python")
