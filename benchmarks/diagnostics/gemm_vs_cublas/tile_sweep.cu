// Whether any plain CUTLASS sm90 configuration (tile, cluster, cooperative or ping-pong, scheduler swizzle and raster)
// reaches cuBLAS at the per-GPU shapes where our GEMM trails it, in one process on one GPU with one timer:
//
//   bf16   cuBLAS (cublasGemmEx) against plain CUTLASS on X[M, K] W[K, N] (W N-major, the forward GEMM)
//   fp8    cuBLASLt (e4m3, fast accumulation, as XLA calls it) against plain CUTLASS on X[M, K] W[N, K]^T (both
//          K-major), with and without CUTLASS's fast accumulation
//
// Every configuration runs in four variants (max swizzle 1 / 8, raster AlongN / the scheduler's heuristic); its
// SWEEP line shows the best one in brackets, its SWEEPV line all four. Each output is checked against the reference
// first (outputs poisoned; max |diff| / max |value|, FAILED above 2e-2). Lines:
//
//   SWEEP <section> <MxKxN> <config>[<variant>] <us> <ratio to cuBLAS / cuBLASLt> <check>
//   BEST <section> <MxKxN> <config>[<variant>] <us> <ratio>
//
//   tile_sweep                      # the built-in shapes
//   tile_sweep 2048x2560x5120 ...   # per-GPU MxKxN shapes instead
//   tile_sweep --bf16 | --fp8 ...   # one section only
//
// SWEEP_CONFIGS=<name>,... runs only those configurations; SWEEP_PROFILE=<n> times by profiler and SWEEP_ENERGY=<s>
// at the power cap, with energy per call, instead of by loops (tile_sweep.cuh).
//
// cuBLAS and cuBLASLt are loaded with dlopen: set FLUX_PROBE_CUBLAS to libcublas.so.N and put its directory (which
// holds libcublasLt.so.N too) on LD_LIBRARY_PATH. Build: build.sh (no flux_jax libraries needed).
#include <cstring>
#include <vector>

#include "tile_sweep.cuh"

int main(int argc, char** argv) {
  bool bf16 = true, fp8 = true;
  int first = 1;
  if (argc > 1 && (std::strcmp(argv[1], "--bf16") == 0 || std::strcmp(argv[1], "--fp8") == 0)) {
    bf16 = argv[1][2] == 'b';
    fp8 = !bf16;
    first = 2;
  }
  // Per-GPU GEMMs (M x K x N) where our GEMM trailed cuBLAS, and two large square-ish ones as controls.
  std::vector<Shape> parsed = {
      {2048, 2560, 5120, ""}, {2048, 8192, 5120, ""}, {2048, 6912, 5120, ""}, {2048, 4096, 3072, ""},
      {4096, 3072, 4608, ""}, {8192, 2048, 4096, ""}, {8192, 8192, 8192, ""}, {4096, 8192, 8192, ""},
  };
  if (argc > first) {
    parsed.clear();
    if (!ParseShapes(argc, argv, first, &parsed)) return 2;
  }
  std::vector<SweepShape> shapes;
  for (const Shape& s : parsed) shapes.push_back({s.m, s.k, s.n});
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  printf("%s, %d SMs; variants: sw<max swizzle>,<raster: N = AlongN, H = heuristic>\n", prop.name,
         prop.multiProcessorCount);
  if (bf16) SweepBf16(shapes);
  if (fp8) SweepFp8(shapes);
  const cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 1;
}
