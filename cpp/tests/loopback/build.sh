#!/usr/bin/env bash
# Configures <build-dir> with the CUDA backend and the loopback tests, and builds only the two
# test executables (and flux_jax_cuda / flux_jax_kernels, which they link).
#
#   cpp/tests/loopback/build.sh <build-dir> [jobs]
#
# Needs nvcc and a Python (PYTHON, default python3) with the package's build requirements:
# jaxlib (XLA FFI headers), nanobind and nvidia-cutlass.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 <build-dir> [jobs]" >&2
  exit 2
fi
root=$(cd "$(dirname "$0")/../../.." && pwd)
python=$(command -v "${PYTHON:-python3}")
cmake -S "$root" -B "$1" -DCMAKE_BUILD_TYPE=Release -DFLUX_JAX_CUDA=ON -DFLUX_JAX_BUILD_LOOPBACK_TESTS=ON \
  -DPython_EXECUTABLE="$python"
cmake --build "$1" --target ops_loopback rs_decode_loopback -j "${2:-2}"
