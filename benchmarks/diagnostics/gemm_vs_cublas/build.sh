#!/usr/bin/env bash
# Builds gemm_vs_cublas, gated_vs_plain, decode_gemm_vs_cublas and tile_sweep into <out-dir>. The first three
# link the static libraries of a CMake build tree of this repository that has the CUDA backend: any build with
# FLUX_JAX_CUDA=ON after `cmake --build <build-dir> --target flux_jax_cuda` (the loopback tests' build,
# cpp/tests/loopback/build.sh, has them too). tile_sweep (plain CUTLASS only) needs no build tree: `--tile-sweep`
# builds only it.
#
#   benchmarks/diagnostics/gemm_vs_cublas/build.sh <build-dir> <out-dir>
#   benchmarks/diagnostics/gemm_vs_cublas/build.sh --tile-sweep <out-dir>
#
# Needs nvcc and a Python (PYTHON, default python3) with nvidia-cutlass for the CUTLASS headers
# (or CUTLASS_DIR: a CUTLASS source root). No cuBLAS headers or libraries: cuBLAS is loaded at run
# time (README.md). NVCC_EXTRA: more nvcc flags, e.g. "-Xptxas -v" for registers and spills per kernel.
set -euo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: $0 <build-dir> <out-dir> | $0 --tile-sweep <out-dir>" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
build=$1
out=$2
cutlass=${CUTLASS_DIR:-$("${PYTHON:-python3}" -c "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source'))")}
flags=(-gencode=arch=compute_90a,code=sm_90a -O3 -DNDEBUG --expt-relaxed-constexpr -std=c++17
       -I"$cutlass/include" -I"$cutlass/tools/util/include" -I"$root/cpp/kernels/cuda" -I"$root/cpp/include")
read -ra extra <<< "${NVCC_EXTRA:-}"
flags+=("${extra[@]}")
mkdir -p "$out"

# tile_sweep: its two sections (several CUTLASS kernels each) compile in parallel, then link with main.
tile_sweep() {
  local pids=()
  for unit in tile_sweep_bf16 tile_sweep_fp8 tile_sweep; do
    nvcc "${flags[@]}" -c "$here/$unit.cu" -o "$out/$unit.o" & pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  nvcc -gencode=arch=compute_90a,code=sm_90a "$out/tile_sweep.o" "$out/tile_sweep_bf16.o" "$out/tile_sweep_fp8.o" \
       -ldl -o "$out/tile_sweep"
  ls -l "$out/tile_sweep"
}
if [[ $build == --tile-sweep ]]; then
  tile_sweep
  exit 0
fi

libs=("$build/cpp/libflux_jax_cuda.a" "$build/cpp/libflux_jax_kernels.a")
for lib in "${libs[@]}"; do
  [[ -f $lib ]] || { echo "$lib missing: cmake --build $build --target flux_jax_cuda" >&2; exit 2; }
done
nvcc "${flags[@]}" "$here/gemm_vs_cublas.cu" "${libs[@]}" -ldl -o "$out/gemm_vs_cublas" & first=$!
nvcc "${flags[@]}" "$here/gated_vs_plain.cu" "${libs[@]}" -ldl -o "$out/gated_vs_plain" & second=$!
nvcc "${flags[@]}" "$here/decode_gemm_vs_cublas.cu" "${libs[@]}" -ldl -o "$out/decode_gemm_vs_cublas"
wait "$first" "$second"
ls -l "$out/gemm_vs_cublas" "$out/gated_vs_plain" "$out/decode_gemm_vs_cublas"
tile_sweep
