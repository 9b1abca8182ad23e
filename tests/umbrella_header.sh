#!/usr/bin/env bash
# Fails when a public header under include/deepnex/ is not included by the
# umbrella header include/deepnex/deepnex.h.
# Usage: umbrella_header.sh SOURCE_DIR
set -euo pipefail
cd "$1/include"
missing=0
for h in $(find deepnex -name '*.h' ! -path deepnex/deepnex.h | sort); do
  if ! grep -qx "#include \"$h\"" deepnex/deepnex.h; then
    echo "deepnex/deepnex.h does not include $h"
    missing=1
  fi
done
exit $missing
