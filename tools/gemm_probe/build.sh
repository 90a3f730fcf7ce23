#!/bin/bash
# Builds the GEMM probes into .whl/probe/ (carried to the device). $1: a wheel build dir whose
# cpp/libflux_jax_*.a gemm_ours links (default /tmp/fjbuild).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-/tmp/fjbuild}
cutlass=$(python -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))")
flags=(-O3 -DNDEBUG -arch=sm_90a --expt-relaxed-constexpr -std=c++17
       -I"$cutlass/include" -I"$cutlass/tools/util/include" -Icpp/kernels/cuda -Icpp/include)
mkdir -p .whl/probe
nvcc "${flags[@]}" tools/gemm_probe/gemm_orient.cu -o .whl/probe/gemm_orient & orient=$!
nvcc "${flags[@]}" tools/gemm_probe/gemm_ours.cu "$build/cpp/libflux_jax_cuda.a" "$build/cpp/libflux_jax_kernels.a" \
  -o .whl/probe/gemm_ours & ours=$!
nvcc "${flags[@]}" tools/gemm_probe/gemm_cublas.cu "$build/cpp/libflux_jax_cuda.a" "$build/cpp/libflux_jax_kernels.a" \
  -ldl -o .whl/probe/gemm_cublas & cublas=$!
wait "$orient"; wait "$ours"; wait "$cublas"
nvcc "${flags[@]}" tools/gemm_probe/gemm_widths.cu -ldl -o .whl/probe/gemm_widths
nvcc "${flags[@]}" tools/gemm_probe/push_probe.cu -o .whl/probe/push_probe
ls -la .whl/probe/gemm_orient .whl/probe/gemm_ours .whl/probe/gemm_cublas .whl/probe/gemm_widths .whl/probe/push_probe
