// Shared by the GEMM diagnostics: a plain CUTLASS sm90 GEMM (bf16 or FP8, cooperative or ping-pong, no flux_jax
// hooks), its arguments for packed tensors, a cudaEvent timer and a random fill.
#pragma once

#include <algorithm>
#include <cstdio>
#include <type_traits>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "wide_tile_mainloop.cuh"

using E = cutlass::bfloat16_t;
using RM = cutlass::layout::RowMajor;
using CM = cutlass::layout::ColumnMajor;

// D = A * B with f32 accumulation and a bf16 D, A and B of element EAB (bf16, or FP8 cutlass::float_e4m3_t);
// layouts in CUTLASS 2.x terms (for A RowMajor = K-major, for B ColumnMajor = K-major), TM x TN tiles 128 bytes of K
// deep (64 bf16, 128 FP8: one 128-byte swizzle row per stage), a ClusterM x ClusterN cluster (ClusterN CTAs of a
// cluster share their A tile through TMA multicast, ClusterM CTAs their B tile). Cooperative: both consumer
// warpgroups share a tile and store it together (the tensor cores idle meanwhile); ping-pong: each warpgroup owns a
// tile, one's epilogue runs under the other's mainloop. FP8 needs both operands K-major (wgmma reads 8-bit operands
// from shared memory only K-major). kFastAccum (FP8 only): the FP8FastAccum schedules, which keep the sums in the
// tensor cores' accumulators instead of promoting them to f32 registers every few k-blocks (cuBLASLt's FAST_ACCUM,
// which XLA sets).
template <class EAB, class LA, class LB, class LC, int TM, int TN, int ClusterM, int ClusterN,
          class TileScheduler = void, bool kPingpong = false, bool kFastAccum = false>
struct PlainGemmT {
  using MainSchedule =
      std::conditional_t<kPingpong,
                         std::conditional_t<kFastAccum, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum,
                                            cutlass::gemm::KernelTmaWarpSpecializedPingpong>,
                         std::conditional_t<kFastAccum, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                                            cutlass::gemm::KernelTmaWarpSpecializedCooperative>>;
  using EpiSchedule = std::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                         cutlass::epilogue::TmaWarpSpecializedCooperative>;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<EAB>::value;  // elements in 16 bytes (TMA)
  using Tile = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<8 * kAlignAB>>;
  using Cluster = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, E, LC, 8, E, LC, 8, EpiSchedule>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, EAB, LA, kAlignAB, EAB, LB, kAlignAB, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      MainSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Main, Epi, TileScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// A cooperative tile wider than one MMA instruction, e.g. 128x320 from m64n160 atoms (cuBLAS's "320x128 coopB"
// tile on N = 5120 problems): the product's WideTileMainloop (cpp/kernels/cuda/wide_tile_mainloop.cuh) in a plain
// kernel with CUTLASS's persistent scheduler and epilogue. m64n160 needs CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
// before the first CUTLASS include. FP8 runs with fast accumulation only.
template <class EAB, class LB, int TM, int TN, int kAtomN, int ClusterM>
struct PlainWideGemmT {
  static constexpr bool kFp8 = cutlass::sizeof_bits<EAB>::value == 8;
  using Tile = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<1024 / cutlass::sizeof_bits<EAB>::value>>;
  using Cluster = cute::Shape<cute::Int<ClusterM>, cute::_1, cute::_1>;
  using Schedule = std::conditional_t<kFp8, cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                                      cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, E, RM, 8, E, RM, 8,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Main =
      typename flux_jax::cuda::WideTileMainloop<EAB, EAB, std::is_same_v<LB, CM>, Tile, Cluster, kAtomN, Schedule,
                                                static_cast<int>(sizeof(typename Epi::SharedStorage))>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Main, Epi,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The bf16 GEMM with a ClusterM x 1 cluster (what gemm_vs_cublas and decode_gemm_vs_cublas time).
template <class LA, class LB, class LC, int TM, int TN, int ClusterM, class TileScheduler = void,
          bool kPingpong = false>
using PlainGemm = PlainGemmT<E, LA, LB, LC, TM, TN, ClusterM, 1, TileScheduler, kPingpong>;

// Arguments of the CUTLASS problem (m, n, k) over packed tensors a, b, d (alpha 1, beta 0).
template <class Kernel>
typename Kernel::Arguments PlainArguments(int m, int n, int k, const typename Kernel::ElementA* a,
                                          const typename Kernel::ElementB* b, E* d) {
  typename Kernel::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {m, n, k, 1};
  args.mainloop.ptr_A = a;
  args.mainloop.dA = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {m, k, 1});
  args.mainloop.ptr_B = b;
  args.mainloop.dB = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {n, k, 1});
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.ptr_C = d;
  args.epilogue.dC = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, {m, n, 1});
  args.epilogue.ptr_D = d;
  args.epilogue.dD = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, n, 1});
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  args.hw_info.sm_count = prop.multiProcessorCount;
  return args;
}

// Microseconds per call of f: 5 warm-up calls, then the best of `rounds` loops of `iters` calls
// between two events (back to back on the default stream: no host gaps inside a loop).
template <class F>
float BestUsPerCall(F&& f, int iters, int rounds) {
  for (int i = 0; i < 5; ++i) f();
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  for (int r = 0; r < rounds; ++r) {
    cudaEventRecord(e0);
    for (int i = 0; i < iters; ++i) f();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    best = std::min(best, ms * 1000.f / iters);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) printf("cuda error %s\n", cudaGetErrorString(err));
  return best;
}

// Microseconds per call of plain CUTLASS GEMM I on (m, n, k) with a swizzle and raster order.
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

// Microseconds per call of plain CUTLASS GEMM I whose scheduler is CUTLASS's stream-K
// (cutlass::gemm::StreamKScheduler) in `mode`: initialize() runs inside every call, since it
// zeroes the reduction locks the kernel counts up and never resets. ws holds ws_bytes.
template <class I, class Mode>
float TimeStreamK(int m, int n, int k, const E* a, const E* b, E* d, int iters, void* ws, size_t ws_bytes, Mode mode) {
  using K = typename I::Kernel;
  auto args = PlainArguments<K>(m, n, k, a, b, d);
  args.scheduler.max_swizzle_size = 8;
  args.scheduler.decomposition_mode = mode;
  typename I::Gemm g;
  if (g.can_implement(args) != cutlass::Status::kSuccess) return -1;
  if (I::Gemm::get_workspace_size(args) > ws_bytes) return -3;
  if (g.initialize(args, ws) != cutlass::Status::kSuccess) return -2;
  return BestUsPerCall(
      [&] {
        g.initialize(args, ws);
        g.run();
      },
      iters, 7);
}

// Hash-based normal values (Box-Muller on two hashed uniforms), (N(0, 1) + 0.25) * scale: the operands
// benchmarks/gemm_parity.py makes (x: scale 1; w: 1 / sqrt(K)). A GEMM's power at the cap depends on its operands'
// bits, so comparing with JAX runs needs the same distribution.
template <class T>
__global__ void FillNormal(T* p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed, g = (unsigned)i * 2246822519u ^ (seed * 40503u + 1u);
    h ^= h >> 13;
    h *= 0x5bd1e995;
    h ^= h >> 15;
    g ^= g >> 13;
    g *= 0x5bd1e995;
    g ^= g >> 15;
    const float u1 = ((h >> 8) + 1) / 16777217.f, u2 = (g >> 8) / 16777216.f;
    p[i] = T((sqrtf(-2.f * logf(u1)) * cospif(2.f * u2) + 0.25f) * scale);
  }
}

// Hash-based values in [-0.5, 0.5): random-looking, never zero everywhere, reproducible. A template (bf16 or FP8 T),
// so that translation units linked together may all include this header.
template <class T>
__global__ void Fill(T* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995;
    h ^= h >> 15;
    p[i] = T((float)(h & 0xffff) / 65536.f - 0.5f);
  }
}
