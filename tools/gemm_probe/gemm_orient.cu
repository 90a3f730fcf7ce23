// Standalone probe: does computing D^T = W^T X^T (nvjet's orientation: 160 rows of X per tile,
// 128 columns of W) beat our 128x256 orientation on the RS per-GPU shapes?  Plain CUTLASS, no gating.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <cstdio>
#include <vector>
#include <cuda_runtime.h>
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using E = cutlass::bfloat16_t;
using RM = cutlass::layout::RowMajor;
using CM = cutlass::layout::ColumnMajor;

template <class LA, class LB, class LC, int TM, int TN, int CM_, class Sched = cutlass::gemm::KernelTmaWarpSpecializedCooperative,
          class ESched = cutlass::epilogue::TmaWarpSpecializedCooperative>
struct Inst {
  using Tile = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::_64>;
  using Cluster = cute::Shape<cute::Int<CM_>, cute::_1, cute::_1>;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, E, LC, 8, E, LC, 8, ESched>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E, LA, 8, E, LB, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      Sched>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Runs D = A*B for a CUTLASS problem (m, n, k) with the instance's layouts; returns us per call.
template <class I>
float Time(int m, int n, int k, const E* a, const E* b, E* d, int iters, void* ws) {
  using K = typename I::Kernel;
  typename K::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {m, n, k, 1};
  args.mainloop.ptr_A = a;
  args.mainloop.dA = cutlass::make_cute_packed_stride(typename K::StrideA{}, {m, k, 1});
  args.mainloop.ptr_B = b;
  args.mainloop.dB = cutlass::make_cute_packed_stride(typename K::StrideB{}, {n, k, 1});
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.ptr_C = d;
  args.epilogue.dC = cutlass::make_cute_packed_stride(typename K::StrideC{}, {m, n, 1});
  args.epilogue.ptr_D = d;
  args.epilogue.dD = cutlass::make_cute_packed_stride(typename K::StrideD{}, {m, n, 1});
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  args.hw_info.sm_count = prop.multiProcessorCount;
  typename I::Gemm g;
  if (g.can_implement(args) != cutlass::Status::kSuccess) { printf("cannot implement\n"); return -1; }
  if (g.initialize(args, ws) != cutlass::Status::kSuccess) { printf("init failed\n"); return -1; }
  for (int i = 0; i < 5; ++i) g.run();
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  float best = 1e30f;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(e0);
    for (int i = 0; i < iters; ++i) g.run();
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    best = std::min(best, ms * 1000.f / iters);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) printf("cuda error %s\n", cudaGetErrorString(err));
  return best;
}

__global__ void Fill(E* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
    p[i] = E((float)(h & 0xffff) / 65536.f - 0.5f);
  }
}
__global__ void MaxDiff(const E* d, const E* dt, int M, int N, float* out) {
  // d: [M, N] row-major; dt: column-major (N, M) = the same element order
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)M * N; i += gridDim.x * blockDim.x) {
    float x = fabsf(float(d[i]) - float(dt[i]));
    atomicMax((int*)out, __float_as_int(x));
  }
}

using Ours = Inst<RM, RM, RM, 128, 256, 1>;                 // D[M,N] = X[M,K] W[K,N], N-major W
using Ours256x128 = Inst<RM, RM, RM, 256, 128, 1>;
using Swap160 = Inst<CM, CM, CM, 128, 160, 1>;             // D^T[N,M] = W^T X^T: A' = W (N-major), B' = X (K-major)
using Swap160c2 = Inst<CM, CM, CM, 128, 160, 2>;
using Swap256 = Inst<CM, CM, CM, 128, 256, 1>;
using Swap192 = Inst<CM, CM, CM, 128, 192, 1>;

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
