#!/usr/bin/env bash
# Compile the native parts in place. The package works without them (pure-Python and
# plain-XLA fallbacks, same results), only more slowly:
#  - opt_serving/_speedups.pyx (Cython): host-side helpers;
#  - opt_serving/csrc/*.cc (C++) -> opt_serving/_cpu_kernels.so: XLA FFI custom calls for the CPU
#    backend (opt_serving/backend/cpu/): oneDNN matrix products on pre-packed float32, bfloat16
#    and int8 weights, an argmax, a decode attention, the screened greedy head and the layer norm.
#    Needs a C++17 compiler and oneDNN's headers and library (the onednn-cpu-gomp and
#    onednn-devel-cpu-gomp wheels in requirements.txt put them under the venv's include/, lib/).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
CXX="${CXX:-g++}"
"$PYTHON" setup.py -q build_ext --inplace
"$PYTHON" -c "import opt_serving._speedups as m; print('built', m.__file__)"

read -r JAX_INCLUDE PREFIX < <("$PYTHON" -c "import jax, sys; print(jax.ffi.include_dir(), sys.prefix)")
if [ -f "$PREFIX/include/dnnl.hpp" ] && command -v "$CXX" >/dev/null; then
  # one object a file, as many compiled at once as there are cores (in one process they took 80 s on 2 cores)
  OBJ="$(mktemp -d)"
  trap 'rm -rf "$OBJ"' EXIT
  printf '%s\n' opt_serving/csrc/*.cc | xargs -P "$(nproc)" -I{} sh -c \
    '"$0" -O3 -fopenmp -std=c++20 -fPIC -w -c "$1" -o "$2/$(basename "$1" .cc).o" -I"$3" -I"$4/include"' \
    "$CXX" {} "$OBJ" "$JAX_INCLUDE" "$PREFIX"
  "$CXX" -fopenmp -shared "$OBJ"/*.o -o opt_serving/_cpu_kernels.so -L"$PREFIX/lib" -ldnnl -Wl,-rpath,"$PREFIX/lib"
  "$PYTHON" -c "import ctypes; ctypes.CDLL('opt_serving/_cpu_kernels.so').OptOnednnMatmulLowp; print('built opt_serving/_cpu_kernels.so')"
else
  echo "not building opt_serving/_cpu_kernels.so (no oneDNN headers under $PREFIX/include or no $CXX):" \
       "CPU matrix products run on XLA's own kernels"
fi
