// tile_sweep's bf16 section: cuBLAS (cublasGemmEx, what XLA's jnp.dot calls) against plain CUTLASS sm90
// configurations on the forward GEMM's layout, D[M, N] = X[M, K] W[K, N], all row-major (W N-major), bf16 with f32
// accumulation, persistent tile scheduler. Cluster RxC: R CTAs along M share (multicast) their B tile, C CTAs along N
// their A tile.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED  // m64n160 atoms
#include "cublaslt_loader.cuh"

namespace {

using PS = cutlass::gemm::PersistentScheduler;
template <int TM, int TN, int CLM, int CLN, bool kPingpong = false>
using Bf16 = PlainGemmT<E, RM, RM, RM, TM, TN, CLM, CLN, PS, kPingpong>;

template <class I>
Config Make(const char* name, const E* x, const E* w, E* d, void* ws, size_t ws_bytes) {
  return {name, [=](const SweepShape& s, Variant v) { return MakePlain<I>(s.m, s.n, s.k, x, w, d, ws, ws_bytes, v); }};
}

// The same GEMM in cuBLAS's orientation, D^T[N, M] = W^T[N, K] X^T[K, M] (CUTLASS's M is our N): W^T is M-major,
// X^T K-major, D^T column-major, all over the same buffers. A cluster RxC there shares X's rows among R CTAs along N.
template <class I>
Config MakeT(const char* name, const E* x, const E* w, E* d, void* ws, size_t ws_bytes) {
  return {name, [=](const SweepShape& s, Variant v) { return MakePlain<I>(s.n, s.m, s.k, w, x, d, ws, ws_bytes, v); }};
}
template <int TM, int TN, int CLM, int CLN, bool kPingpong = false>
using Bf16T = PlainGemmT<E, CM, CM, CM, TM, TN, CLM, CLN, PS, kPingpong>;

}  // namespace

void SweepBf16(const std::vector<SweepShape>& shapes) {
  std::vector<Shape> probe;
  for (const SweepShape& s : shapes) probe.push_back({s.m, s.k, s.n, "sweep"});
  constexpr size_t kWsBytes = size_t{64} << 20;
  const ProbeBuffers buf(probe, kWsBytes);
  const E *x = buf.x, *w = buf.w;
  E* d = buf.d;
  Cublas cublas;
  const bool have_cublas = cublas.Load();
  // cuBLAS checked once per shape (its status), then run as is.
  auto make_ref = [&](const SweepShape& s, E* out) -> Runner {
    if (!have_cublas || cublas.Run(s.m, s.n, s.k, x, w, out) != 0) return {};
    return [&cublas, s, x, w, out] { cublas.Run(s.m, s.n, s.k, x, w, out); };
  };
  // 128x192 and 128x160: N tiles that divide N = 5120 / 4608 / 3072 into fewer partial waves than 256; 256x128 and
  // 2x1 clusters: the B tile (the weight) read once per two M tiles; ping-pong: the epilogue under the other
  // warpgroup's mainloop; 256x160 and 128x320 (two m64n160 MMAs per warpgroup and k-step): 1.9 waves of tiles at
  // 2048 x N = 5120, as cuBLAS's 320x128 kernels.
  std::vector<Config> configs = {
      Make<Bf16<128, 256, 1, 1>>("coop_128x256_c1x1", x, w, d, buf.ws, kWsBytes),
      Make<Bf16<128, 256, 1, 2>>("coop_128x256_c1x2", x, w, d, buf.ws, kWsBytes),
      Make<Bf16<256, 128, 1, 2>>("coop_256x128_c1x2", x, w, d, buf.ws, kWsBytes),
      Make<Bf16<256, 128, 2, 1>>("coop_256x128_c2x1", x, w, d, buf.ws, kWsBytes),
      Make<Bf16<128, 192, 2, 1>>("coop_128x192_c2x1", x, w, d, buf.ws, kWsBytes),
      Make<Bf16<128, 160, 2, 1>>("coop_128x160_c2x1", x, w, d, buf.ws, kWsBytes),
      Make<Bf16<128, 128, 1, 2, true>>("pp_128x128_c1x2", x, w, d, buf.ws, kWsBytes),
      Make<Bf16<128, 128, 2, 1, true>>("pp_128x128_c2x1", x, w, d, buf.ws, kWsBytes),
      Make<Bf16<64, 256, 1, 1, true>>("pp_64x256_c1x1", x, w, d, buf.ws, kWsBytes),
      Make<Bf16<256, 160, 2, 1>>("coop_256x160_c2x1", x, w, d, buf.ws, kWsBytes),
      Make<PlainWideGemmT<E, RM, 128, 320, 160, 2>>("coop_128x320_c2x1", x, w, d, buf.ws, kWsBytes),
      Make<PlainWideGemmT<E, RM, 128, 320, 160, 1>>("coop_128x320_c1x1", x, w, d, buf.ws, kWsBytes),
      // cuBLAS's orientation: nvjet's 128x160 ping-pong 2x1 (XLA's pick at 16384 x 3072 x 8192 and most N % 160
      // shapes) and 256x128 cooperative 1x2 (at 8192^3), named in that orientation.
      MakeT<Bf16T<128, 160, 2, 1, true>>("t_pp_128x160_c2x1", x, w, d, buf.ws, kWsBytes),
      MakeT<Bf16T<128, 128, 2, 1, true>>("t_pp_128x128_c2x1", x, w, d, buf.ws, kWsBytes),
      MakeT<Bf16T<256, 128, 1, 2>>("t_coop_256x128_c1x2", x, w, d, buf.ws, kWsBytes),
  };
  configs.push_back(CublasLtAutotunedBf16(x, w, d));
  printf("bf16: us per call (best of 7 loops, min of 2 passes); ratio = config / cuBLAS\n");
  RunSweep("bf16", "cuBLAS", shapes, 650.0, make_ref, configs, d, buf.d2, buf.acc);
}
