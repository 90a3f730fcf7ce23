// tile_sweep's FP8 section: cuBLASLt (the FP8 matmul XLA calls: e4m3 operands, f32 compute and scale, fast
// accumulation) against plain CUTLASS sm90 configurations on D[M, N] = X[M, K] W[N, K]^T, X and W e4m3 row-major
// (both K-major, as Hopper's FP8 wgmma needs), D bf16, per-tensor scales 1, persistent tile scheduler.
// The check's reference accumulates fast: CUTLASS's fastaccum configurations matched it bit for bit on an H200, the
// others differed by 0.4-1.7e-2 at K = 2048-8192 (the reference's error, near the 2e-2 bar: at larger K they may
// read FAILED for that reason alone). cuBLASLt: cublaslt_loader.cuh; `cublaslt_autotuned` is XLA's pick.
#include <string>

#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED  // m64n160 and m64n176 atoms
#include "cublaslt_loader.cuh"

namespace {

using F8 = cutlass::float_e4m3_t;

template <int TM, int TN, int CLM, int CLN, bool kPingpong = false, bool kFastAccum = false>
using Fp8 = PlainGemmT<F8, RM, CM, RM, TM, TN, CLM, CLN, cutlass::gemm::PersistentScheduler, kPingpong, kFastAccum>;

template <class I>
Config Make(const char* name, const F8* x, const F8* w, E* d, void* ws, size_t ws_bytes) {
  return {name, [=](const SweepShape& s, Variant v) { return MakePlain<I>(s.m, s.n, s.k, x, w, d, ws, ws_bytes, v); }};
}

}  // namespace

void SweepFp8(const std::vector<SweepShape>& shapes) {
  size_t max_mk = 0, max_nk = 0, max_mn = 0;
  for (const SweepShape& s : shapes) {
    max_mk = std::max(max_mk, (size_t)s.m * s.k);
    max_nk = std::max(max_nk, (size_t)s.n * s.k);
    max_mn = std::max(max_mn, (size_t)s.m * s.n);
  }
  constexpr size_t kWsBytes = size_t{64} << 20;
  F8 *x, *w;
  E *d, *ref_d;
  void* ws;
  unsigned* acc;
  cudaMalloc(&x, max_mk);
  cudaMalloc(&w, max_nk);
  cudaMalloc(&d, max_mn * 2);
  cudaMalloc(&ref_d, max_mn * 2);
  cudaMalloc(&ws, kWsBytes);
  cudaMalloc(&acc, 8);
  Fill<<<1024, 256>>>(x, max_mk, 3);
  Fill<<<1024, 256>>>(w, max_nk, 4);
  CublasLt lt;
  const bool have_lt = lt.Load();
  // XLA's FP8 dot in column-major terms: D^T[N, M] = W[N, K] X^T[K, M], W as cuBLASLt's A (stored K x N,
  // transposed: FP8 needs this "TN" form) and X as its B (K x M); the heuristic's first algorithm.
  auto make_ref = [&](const SweepShape& s, E* out) -> Runner {
    return have_lt ? lt.Make({CUDA_R_8F_E4M3, true, true, s.n, s.m, s.k, w, x, out}) : Runner{};
  };
  // Tile K 128 (one 128-byte row of e4m3). Without fast accumulation the mainloop keeps a second f32 accumulator to
  // promote into every 4 k-blocks: with 128 accumulators per thread (a 64x256 or 128x128 warpgroup tile) the two no
  // longer fit in registers and spill (ptxas: 128x256 and 256x128 cooperative, 128x128 and 64x256 ping-pong), so
  // those shapes run only with fast accumulation ("fastaccum": no second accumulator, what cuBLASLt runs under XLA).
  const std::vector<Config> configs = {
      Make<Fp8<128, 128, 2, 1>>("coop_128x128_c2x1", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 128, 1, 2>>("coop_128x128_c1x2", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 256, 1, 1, false, true>>("coop_128x256_c1x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 128, 2, 1, false, true>>("coop_128x128_c2x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<256, 128, 1, 2, false, true>>("coop_256x128_c1x2_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 128, 1, 2, true, true>>("pp_128x128_c1x2_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<64, 256, 1, 1, true, true>>("pp_64x256_c1x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 128, 2, 1, true, true>>("pp_128x128_c2x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<256, 160, 2, 1, false, true>>("coop_256x160_c2x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<PlainWideGemmT<F8, CM, 128, 320, 160, 2>>("coop_128x320_c2x1_fastaccum", x, w, d, ws, kWsBytes),
      // XLA's FP8 kernels at 16384 rows (nvjet_sm90_qqsss_176x128 / 168x128, 1x2 clusters in cuBLAS's
      // orientation): 176 or 168 of our columns, 128 rows, two row tiles per cluster.
      Make<Fp8<128, 176, 2, 1, true, true>>("pp_128x176_c2x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 176, 2, 1, false, true>>("coop_128x176_c2x1_fastaccum", x, w, d, ws, kWsBytes),
      Make<Fp8<128, 160, 2, 1, true, true>>("pp_128x160_c2x1_fastaccum", x, w, d, ws, kWsBytes),
      CublasLtAutotunedFp8(x, w, d),
  };
  printf("fp8: us per call (best of 7 loops, min of 2 passes); ratio = config / cuBLASLt (fast accumulation)\n");
  RunSweep("fp8", "cuBLASLt", shapes, 1200.0, make_ref, configs, d, ref_d, acc);
}
