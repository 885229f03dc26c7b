#!/usr/bin/env bash
# Compile the Cython extension(s) in place. The package works without them
# (pure-Python fallback, same results), only more slowly.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
"$PYTHON" setup.py -q build_ext --inplace
"$PYTHON" -c "import opt_serving._speedups as m; print('built', m.__file__)"
