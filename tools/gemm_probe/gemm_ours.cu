// Probe: our gated GEMM (RunGemm, nothing gated) vs plain CUTLASS on the same shapes, same
// process, same timing: 128x256 cooperative (our schedule without our hooks) and ping-pong
// 128x128 / 64x256, whose epilogues hide under the other warpgroup's mainloop. At per-GPU
// K = 2048 (Llama-8B out-projection, TP=2) a cooperative tile spends ~20 us in its mainloop and
// ~1-2 us storing with the tensor cores idle: the ~8% our GEMM trails XLA's there?
#include "gemm_plan.h"
#include "probe_common.cuh"

template <int TN>
using Plain = PlainGemm<RM, RM, RM, 128, TN, 1, cutlass::gemm::PersistentScheduler>;
template <int TM, int TN>
using Pingpong = PlainGemm<RM, RM, RM, TM, TN, 1, cutlass::gemm::PersistentScheduler, true>;

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
  int shapes[][3] = {{2048, 2048, 4096}, {4096, 2048, 4096}, {8192, 2048, 4096}, {16384, 2048, 4096},
                     {4096, 4096, 8192}, {16384, 4096, 8192}, {4096, 7168, 4096}, {8192, 8192, 8192}};
  size_t maxe = 16384ull * 8192;
  E *x, *w, *d; void* ws; float* one;
  cudaMalloc(&x, maxe * 2); cudaMalloc(&w, maxe * 2); cudaMalloc(&d, maxe * 2); cudaMalloc(&ws, 64 << 20);
  cudaMalloc(&one, 4); float h1 = 1.f; cudaMemcpy(one, &h1, 4, cudaMemcpyHostToDevice);
  Fill<<<1024, 256>>>(x, maxe, 1); Fill<<<1024, 256>>>(w, maxe, 2);
  printf("%-17s %8s %8s | %8s %8s | %8s %8s %8s\n", "MxKxN", "ours g8", "ours192", "coop sw1", "coop sw8",
         "pp128x128", "pp sw8", "pp64x256");
  // Two passes, the second in reverse column order, so drift in clocks does not favour a column.
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& s : shapes) {
      int M = s[0], K = s[1], N = s[2];
      int it = std::max(3, (int)(20.0 * 8192.0 * 8192 * 8192 / ((double)M * N * K)));
      float t[7];
      auto run = [&](int c) {
        switch (c) {
          case 0: t[0] = TimeOurs(M, N, K, x, w, d, it, one, 8, 256); break;
          case 1: t[1] = TimeOurs(M, N, K, x, w, d, it, one, 8, 192); break;
          case 2: t[2] = TimePlain<Plain<256>>(M, N, K, x, w, d, it, ws, 1, false); break;
          case 3: t[3] = TimePlain<Plain<256>>(M, N, K, x, w, d, it, ws, 8, false); break;
          case 4: t[4] = TimePlain<Pingpong<128, 128>>(M, N, K, x, w, d, it, ws, 1, false); break;
          case 5: t[5] = TimePlain<Pingpong<128, 128>>(M, N, K, x, w, d, it, ws, 8, false); break;
          case 6: t[6] = TimePlain<Pingpong<64, 256>>(M, N, K, x, w, d, it, ws, 1, false); break;
        }
      };
      for (int c = 0; c < 7; ++c) run(pass == 0 ? c : 6 - c);
      printf("%5dx%5dx%5d %8.1f %8.1f | %8.1f %8.1f | %8.1f %8.1f %8.1f\n", M, K, N, t[0], t[1], t[2], t[3],
             t[4], t[5], t[6]);
    }
  }
  cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return 0;
}
