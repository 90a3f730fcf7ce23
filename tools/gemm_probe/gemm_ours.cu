// Probe: our gated GEMM (RunGemm, nothing gated) vs plain CUTLASS 128x256 cooperative on the same
// shapes, same process, same timing: is the gap to XLA ours (scheduler/epilogue) or CUTLASS's?
#include <cstdio>
#include <algorithm>
#include <cuda_runtime.h>
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "gemm_plan.h"

using E = cutlass::bfloat16_t;
using RM = cutlass::layout::RowMajor;
template <int TN, class Sched = cutlass::gemm::PersistentScheduler>
struct Plain {
  using Tile = cute::Shape<cute::_128, cute::Int<TN>, cute::_64>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, E, RM, 8, E, RM, 8,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, E, RM, 8, E, RM, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Main, Epi, Sched>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class F>
float Best(F&& f, int iters) {
  for (int i = 0; i < 5; ++i) f();
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  float best = 1e30f;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(e0);
    for (int i = 0; i < iters; ++i) f();
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    best = std::min(best, ms * 1000.f / iters);
  }
  return best;
}

template <class I>
float TimePlain(int m, int n, int k, const E* a, const E* b, E* d, int iters, void* ws, int swizzle, bool along_n) {
  using K = typename I::Kernel;
  typename K::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {m, n, k, 1};
  args.mainloop.ptr_A = a;
  args.mainloop.dA = cutlass::make_cute_packed_stride(typename K::StrideA{}, {m, k, 1});
  args.mainloop.ptr_B = b;
  args.mainloop.dB = cutlass::make_cute_packed_stride(typename K::StrideB{}, {n, k, 1});
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.ptr_C = d;
  args.epilogue.dC = cutlass::make_cute_packed_stride(typename K::StrideC{}, {m, n, 1});
  args.epilogue.ptr_D = d;
  args.epilogue.dD = cutlass::make_cute_packed_stride(typename K::StrideD{}, {m, n, 1});
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  args.hw_info.sm_count = prop.multiProcessorCount;
  args.scheduler.max_swizzle_size = swizzle;
  using R = typename K::TileScheduler::RasterOrderOptions;
  args.scheduler.raster_order = along_n ? R::AlongN : R::AlongM;
  typename I::Gemm g;
  if (g.can_implement(args) != cutlass::Status::kSuccess) return -1;
  if (g.initialize(args, ws) != cutlass::Status::kSuccess) return -2;
  return Best([&] { g.run(); }, iters);
}

float TimeOurs(int m, int n, int k, const E* a, const E* b, E* d, int iters, const float* one, int group, int bn) {
  flux_jax::cuda::GemmPlan p;
  p.m = m; p.n = n; p.k = k; p.a = a; p.b = b; p.d = d; p.alpha_ptr = one;
  p.group_m_tiles = group; p.block_n = bn;
  cudaDeviceProp prop; cudaGetDeviceProperties(&prop, 0);
  bool ok = true;
  float t = Best([&] {
    if (!flux_jax::cuda::RunGemm(p, flux_jax::DType::kBF16, 0, 0, prop.multiProcessorCount).ok()) ok = false;
  }, iters);
  return ok ? t : -1;
}

__global__ void Fill(E* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995; h ^= h >> 15;
    p[i] = E((float)(h & 0xffff) / 65536.f - 0.5f);
  }
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
