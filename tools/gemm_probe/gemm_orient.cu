// Standalone probe: does computing D^T = W^T X^T (nvjet's orientation: 160 rows of X per tile,
// 128 columns of W) beat our 128x256 orientation on the RS per-GPU shapes?  Plain CUTLASS, no gating.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "probe_common.cuh"

// Runs D = A*B for a CUTLASS problem (m, n, k) with the instance's layouts; returns us per call.
template <class I>
float Time(int m, int n, int k, const E* a, const E* b, E* d, int iters, void* ws) {
  auto args = PlainArguments<typename I::Kernel>(m, n, k, a, b, d);
  typename I::Gemm g;
  if (g.can_implement(args) != cutlass::Status::kSuccess) { printf("cannot implement\n"); return -1; }
  if (g.initialize(args, ws) != cutlass::Status::kSuccess) { printf("init failed\n"); return -1; }
  return BestUsPerCall([&] { g.run(); }, iters, 5);
}

__global__ void MaxDiff(const E* d, const E* dt, int M, int N, float* out) {
  // d: [M, N] row-major; dt: column-major (N, M) = the same element order
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)M * N; i += gridDim.x * blockDim.x) {
    float x = fabsf(float(d[i]) - float(dt[i]));
    atomicMax((int*)out, __float_as_int(x));
  }
}

using Ours = PlainGemm<RM, RM, RM, 128, 256, 1>;                 // D[M,N] = X[M,K] W[K,N], N-major W
using Ours256x128 = PlainGemm<RM, RM, RM, 256, 128, 1>;
using Swap160 = PlainGemm<CM, CM, CM, 128, 160, 1>;             // D^T[N,M] = W^T X^T: A' = W (N-major), B' = X (K-major)
using Swap160c2 = PlainGemm<CM, CM, CM, 128, 160, 2>;
using Swap256 = PlainGemm<CM, CM, CM, 128, 256, 1>;
using Swap192 = PlainGemm<CM, CM, CM, 128, 192, 1>;

int main() {
  int shapes[][3] = {{16384, 4096, 8192}, {4096, 4096, 8192}, {8192, 2048, 4096}, {16384, 2048, 4096},
                     {2048, 2048, 4096}, {4096, 8192, 4096}, {8192, 4096, 14336}, {8192, 8192, 8192}};
  size_t maxe = 16384ull * 14336;
  E *x, *w, *d, *dt; void* ws; float* md;
  cudaMalloc(&x, maxe * 2); cudaMalloc(&w, maxe * 2); cudaMalloc(&d, maxe * 2); cudaMalloc(&dt, maxe * 2);
  cudaMalloc(&ws, 64 << 20); cudaMalloc(&md, 4);
  Fill<<<1024, 256>>>(x, maxe, 1); Fill<<<1024, 256>>>(w, maxe, 2);
  printf("%-18s %9s %9s %9s %9s %9s %9s  maxdiff\n", "MxKxN", "ours", "o256x128", "swap160", "s160c2", "swap256", "swap192");
  for (auto& s : shapes) {
    int M = s[0], K = s[1], N = s[2];
    int it = std::max(3, (int)(20.0 * 8192.0 * 8192 * 8192 / ((double)M * N * K)));
    float t0 = Time<Ours>(M, N, K, x, w, d, it, ws);
    float t1 = Time<Ours256x128>(M, N, K, x, w, d, it, ws);
    float t2 = Time<Swap160>(N, M, K, w, x, dt, it, ws);
    cudaMemset(md, 0, 4); MaxDiff<<<1024, 256>>>(d, dt, M, N, md);
    float diff; cudaMemcpy(&diff, md, 4, cudaMemcpyDeviceToHost);
    float t3 = Time<Swap160c2>(N, M, K, w, x, dt, it, ws);
    float t4 = Time<Swap256>(N, M, K, w, x, dt, it, ws);
    float t5 = Time<Swap192>(N, M, K, w, x, dt, it, ws);
    printf("%5dx%5dx%5d %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f  %.3g\n", M, K, N, t0, t1, t2, t3, t4, t5, diff);
  }
  return 0;
}
