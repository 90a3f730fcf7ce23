#!/bin/bash
# Builds the one-GPU loopback tests into .whl/loopback/ (carried to the device). $1: a wheel build
# dir whose cpp/libflux_jax_*.a they link (default /tmp/fjbuild); $2: the source tree of that build
# (default this checkout), whose headers they include.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-/tmp/fjbuild}
src=${2:-.}
out=${LOOPBACK_OUT:-.whl/loopback}
cutlass=$(python -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))")
flags=(-O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -std=c++17 -I"$cutlass/include"
       -I"$cutlass/tools/util/include" -I"$src/cpp/kernels/cuda" -I"$src/cpp/include")
libs=("$build/cpp/libflux_jax_cuda.a" "$build/cpp/libflux_jax_kernels.a")
mkdir -p "$out"
nvcc "${flags[@]}" tools/loopback/ops_loopback.cu "${libs[@]}" -o "$out/ops_loopback"
# The dense exchange exists where decode_gemm.h has kDecodeLowLatencyMaxRows (branch wip/rs-dense-exchange).
dense=$(grep -q kDecodeLowLatencyMaxRows "$src/cpp/kernels/cuda/decode_gemm.h" && echo -DFLUX_PROBE_DENSE=1 || true)
nvcc "${flags[@]}" $dense tools/loopback/rs_decode_loopback.cu "${libs[@]}" -o "$out/rs_decode_loopback"
ls -la "$out"
