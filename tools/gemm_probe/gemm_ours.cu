// Probe: our gated GEMM (RunGemm, nothing gated) vs plain CUTLASS 128x256 cooperative on the same
// shapes, same process, same timing: is the gap to XLA ours (scheduler/epilogue) or CUTLASS's?
#include "gemm_plan.h"
#include "probe_common.cuh"

template <int TN>
using Plain = PlainGemm<RM, RM, RM, 128, TN, 1, cutlass::gemm::PersistentScheduler>;

template <class I>
float TimePlain(int m, int n, int k, const E* a, const E* b, E* d, int iters, void* ws, int swizzle, bool along_n) {
  using K = typename I::Kernel;
  auto args = PlainArguments<K>(m, n, k, a, b, d);
  args.scheduler.max_swizzle_size = swizzle;
  using R = typename K::TileScheduler::RasterOrderOptions;
  args.scheduler.raster_order = along_n ? R::AlongN : R::AlongM;
  typename I::Gemm g;
  if (g.can_implement(args) != cutlass::Status::kSuccess) return -1;
  if (g.initialize(args, ws) != cutlass::Status::kSuccess) return -2;
  return BestUsPerCall([&] { g.run(); }, iters, 7);
}

float TimeOurs(int m, int n, int k, const E* a, const E* b, E* d, int iters, const float* one, int group, int bn) {
  flux_jax::cuda::GemmPlan p;
  p.m = m; p.n = n; p.k = k; p.a = a; p.b = b; p.d = d; p.alpha_ptr = one;
  p.group_m_tiles = group; p.block_n = bn;
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  bool ok = true;
  float t = BestUsPerCall([&] {
    if (!flux_jax::cuda::RunGemm(p, flux_jax::DType::kBF16, 0, 0, prop.multiProcessorCount).ok()) ok = false;
  }, iters, 7);
  return ok ? t : -1;
}

int main() {
  int shapes[][3] = {{16384, 4096, 8192}, {4096, 4096, 8192}, {8192, 2048, 4096}, {16384, 2048, 4096},
                     {2048, 2048, 4096}, {4096, 8192, 4096}, {8192, 4096, 14336}, {8192, 8192, 8192}};
  size_t maxe = 16384ull * 14336;
  E *x, *w, *d; void* ws; float* one;
  cudaMalloc(&x, maxe * 2); cudaMalloc(&w, maxe * 2); cudaMalloc(&d, maxe * 2); cudaMalloc(&ws, 64 << 20);
  cudaMalloc(&one, 4); float h1 = 1.f; cudaMemcpy(one, &h1, 4, cudaMemcpyHostToDevice);
  Fill<<<1024, 256>>>(x, maxe, 1); Fill<<<1024, 256>>>(w, maxe, 2);
  printf("%-17s %8s %8s %8s %8s | %8s %8s %8s %8s %8s\n", "MxKxN", "ours g8", "ours g1", "ours g16", "ours192",
         "pl sw1M", "pl sw1N", "pl sw2", "pl sw4", "pl sw8");
  for (auto& s : shapes) {
    int M = s[0], K = s[1], N = s[2];
    int it = std::max(3, (int)(20.0 * 8192.0 * 8192 * 8192 / ((double)M * N * K)));
    float o8 = TimeOurs(M, N, K, x, w, d, it, one, 8, 256);
    float o1 = TimeOurs(M, N, K, x, w, d, it, one, 1, 256);
    float o16 = TimeOurs(M, N, K, x, w, d, it, one, 16, 256);
    float o192 = TimeOurs(M, N, K, x, w, d, it, one, 8, 192);
    float p1m = TimePlain<Plain<256>>(M, N, K, x, w, d, it, ws, 1, false);
    float p1n = TimePlain<Plain<256>>(M, N, K, x, w, d, it, ws, 1, true);
    float p2 = TimePlain<Plain<256>>(M, N, K, x, w, d, it, ws, 2, false);
    float p4 = TimePlain<Plain<256>>(M, N, K, x, w, d, it, ws, 4, false);
    float p8 = TimePlain<Plain<256>>(M, N, K, x, w, d, it, ws, 8, false);
    printf("%5dx%5dx%5d %8.1f %8.1f %8.1f %8.1f | %8.1f %8.1f %8.1f %8.1f %8.1f\n", M, K, N, o8, o1, o16, o192, p1m, p1n, p2, p4, p8);
  }
  cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return 0;
}
