#!/usr/bin/env bash
# Builds gemm_vs_cublas and decode_gemm_vs_cublas into <out-dir>. They link the static libraries
# of a CMake build tree of this repository that has the CUDA backend: any build with
# FLUX_JAX_CUDA=ON after `cmake --build <build-dir> --target flux_jax_cuda` (the loopback tests'
# build, cpp/tests/loopback/build.sh, has them too).
#
#   benchmarks/diagnostics/gemm_vs_cublas/build.sh <build-dir> <out-dir>
#
# Needs nvcc and a Python (PYTHON, default python3) with nvidia-cutlass for the CUTLASS headers
# (or CUTLASS_DIR: a CUTLASS source root). No cuBLAS headers or libraries: cuBLAS is loaded at run
# time (README.md).
set -euo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: $0 <build-dir> <out-dir>" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
build=$1
out=$2
libs=("$build/cpp/libflux_jax_cuda.a" "$build/cpp/libflux_jax_kernels.a")
for lib in "${libs[@]}"; do
  [[ -f $lib ]] || { echo "$lib missing: cmake --build $build --target flux_jax_cuda" >&2; exit 2; }
done
cutlass=${CUTLASS_DIR:-$("${PYTHON:-python3}" -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))")}
flags=(-gencode=arch=compute_90a,code=sm_90a -O3 -DNDEBUG --expt-relaxed-constexpr -std=c++17
       -I"$cutlass/include" -I"$cutlass/tools/util/include" -I"$root/cpp/kernels/cuda" -I"$root/cpp/include")
mkdir -p "$out"
nvcc "${flags[@]}" "$here/gemm_vs_cublas.cu" "${libs[@]}" -ldl -o "$out/gemm_vs_cublas" & first=$!
nvcc "${flags[@]}" "$here/decode_gemm_vs_cublas.cu" "${libs[@]}" -ldl -o "$out/decode_gemm_vs_cublas"
wait "$first"
ls -l "$out/gemm_vs_cublas" "$out/decode_gemm_vs_cublas"
