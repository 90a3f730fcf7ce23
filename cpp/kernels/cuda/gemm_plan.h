// One launch of the gated GEMM, described without CUTLASS types.
//
// D[m, n] = alpha * A[m, k] @ op(B) + beta * C[m, n]   (row-major A, C, D)
// op(B): B is w[k, n] row-major ("N-major"), or w[n, k] row-major when b_kmajor
// (the transposed weight of a backward pass, never materialized).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device_sync.cuh"
#include "flux_jax/params.h"
#include "flux_jax/status.h"

namespace flux_jax::cuda {

inline constexpr int kGemmBlockM = 128;        // tile rows of every shipped instance
inline constexpr int kGemmBlockN = 256;        // tile columns of the default instances
inline constexpr int kGemmBlockNNarrow = 192;  // the narrow instances; ping-pong 128x192 in 2x1 clusters
inline constexpr int kGemmBlockN160 = 160;     // 2x1 clusters: cooperative (bf16 / f16, K-major B), FP8 e5m2 ping-pong
inline constexpr int kGemmBlockN128 = 128;     // the 2x1-cluster ping-pong 128x128 instances
inline constexpr int kGemmBlockN320 = 320;     // the 2x1-cluster cooperative 128x320 instances (bf16 / f16)
inline constexpr int kGemmBlockN224 = 224;     // the 1x1 instances for dx whose waves fit N = 6912, 7168
// M tiles swept together across N when the config says 0 (automatic); see the
// tile order in gated_gemm.cuh and docs/decisions/2026-11-30-grouped-tile-order.md.
inline constexpr int kDefaultTileGroupM = 8;

struct GemmPlan {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  // Optional second source for rows [local_first_tile * kGemmBlockM, + local_rows).
  const void* a_local = nullptr;
  int32_t local_rows = 0;
  int32_t local_first_tile = 0;
  const void* b = nullptr;
  bool b_kmajor = false;
  const void* c = nullptr;  // read only when beta != 0
  float beta = 0.0f;
  void* d = nullptr;
  const float* alpha_ptr = nullptr;  // device scalar (1.0f, NaN once poisoned)
  RowGate gate_a;                    // waits before A loads (AllGather)
  RowGate gate_c;                    // waits before C loads (ReduceScatter)
  TileSignal signal_d;               // per-piece counters raised as D tiles are written
  int32_t rotate_m_tiles = 0;
  int32_t group_m_tiles = 1;      // M tiles swept together across N (L2 reuse; gated_gemm.cuh)
  bool serpentine = false;        // odd tile groups sweep N backwards (flux_jax/tile_order.h)
  int32_t block_n = kGemmBlockN;  // tile columns: one of the kGemmBlockN* (HasGemmInstance)
  int32_t cluster_m = 1;          // CTAs per cluster along M (2: B shared by TMA multicast)
  bool pingpong = false;          // the ping-pong schedule (128x128, 128x192, e5m2 128x160; 2x1 clusters only)
  // FP8 (gemm_fp8_instance.cuh): A float8_e4m3fn (or e5m2), B float8_e4m3fn K-major, D = alpha * row_scale[m] *
  // col_scale[n] * A @ op(B) + beta * C in bfloat16.
  bool fp8 = false;
  bool fp8_a_e5m2 = false;           // A in float8_e5m2 (a backward's dy rows; ping-pong 2x1 only)
  const float* row_scale = nullptr;  // [m] of this launch's rows
  const float* col_scale = nullptr;  // [n]
};

// Whether this build has the instance of (block_n, cluster_m, pingpong) for this input: bfloat16
// and float16 alike, 128x256 and 128x192 in 1x1 clusters, and for the K-major (transposed) weight
// 128x224; in 2x1 clusters ping-pong 128x128, cooperative 128x320, for the [K, N] weight ping-pong
// 128x192 and for the K-major weight 128x160.
inline bool HasGemmInstance(DType dtype, bool b_kmajor, int32_t block_n, int32_t cluster_m, bool pingpong = false) {
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  if (pingpong) return cluster_m == 2 && (block_n == kGemmBlockN128 || (block_n == kGemmBlockNNarrow && !b_kmajor));
  if (cluster_m == 1)
    return block_n == kGemmBlockN || block_n == kGemmBlockNNarrow || (block_n == kGemmBlockN224 && b_kmajor);
  if (cluster_m != 2) return false;
  return block_n == kGemmBlockN320 || (block_n == kGemmBlockN160 && b_kmajor);
}

// Launches on `stream`; `sm_count` sizes the persistent grid. `dtype` is D's (and A's and B's
// unless plan.fp8).
Status RunGemm(const GemmPlan& plan, DType dtype, cudaStream_t stream, int device, int sm_count);

// Loads every GEMM instance into the current device's context (see gemm_instance.cuh).
Status PreloadGemmKernels();

}  // namespace flux_jax::cuda
