// Pieces shared by the two CUDA ops: the presence handshake, piece sizing,
// and flag writes through the copy engine.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda_util.h"
#include "flux_jax/params.h"
#include "gemm_plan.h"
#include "stream_ops.h"
#include "workspace.h"

namespace flux_jax::cuda {

// Rows per piece of a chunk: pieces of ~1/8 chunk (>= 8 MiB), a multiple of the
// GEMM tile height, at most kMaxPieces per chunk (where that cap binds, as with a small
// GpuTuning.piece_bytes, pieces may end inside a tile: WaitRows waits for every piece a
// tile touches). Finer pieces start the
// consumer earlier; each costs two copy-engine operations. The 8 MiB floor (was
// 2 MiB) measured 12-15% faster at LLaMA-8B out-projection M = 2048-4096 and 6% at
// 8192, within +-3% elsewhere (2x H200, 2026-11-30; docs/decisions/2026-11-30-piece-size-floor.md).
// `granule_rows`: the rows of one cluster of tiles (kGemmBlockM x GemmPlan.cluster_m), so the
// CTAs of a 2x1 cluster, which share B, wait for the same piece.
inline int32_t PieceRows(int64_t rows, int64_t row_bytes, int64_t requested_bytes, int64_t granule_rows = kGemmBlockM) {
  if (rows <= 0) return 1;
  const int64_t target_bytes =
      requested_bytes > 0 ? requested_bytes : std::max<int64_t>(int64_t{8} << 20, rows * row_bytes / 8);
  int64_t piece = std::max<int64_t>(1, (target_bytes + row_bytes - 1) / row_bytes);
  piece = (piece + granule_rows - 1) / granule_rows * granule_rows;
  piece = std::max<int64_t>(piece, (rows + kMaxPieces - 1) / kMaxPieces);
  return static_cast<int32_t>(std::min(piece, rows));
}

// Launches the pushed ReduceScatter stage 0 is split into (GpuTuning.rs_stage_launches):
// 1 = one launch; n >= 2 = n (at most one per piece); 0 = about one wave of output tiles
// per launch (a whole wave leaves no SM idle; a smaller launch would), at most 8.
inline int32_t StageLaunches(const CommConfig& cfg, int64_t rows, int64_t n, int32_t block_n, int32_t piece_rows,
                             int32_t pieces, int sm_count) {
  if (cfg.tuning.rs_stage_launches == 1 || pieces <= 1 || rows <= 0) return 1;
  if (cfg.tuning.rs_stage_launches > 1)
    return static_cast<int32_t>(std::min<int64_t>(cfg.tuning.rs_stage_launches, pieces));
  const int64_t tiles_n = (n + block_n - 1) / block_n;
  const int64_t wave_rows = std::max<int64_t>(1, sm_count / tiles_n) * kGemmBlockM;
  const int64_t pieces_per_launch = std::max<int64_t>(1, wave_rows / piece_rows);
  const int64_t launches = (pieces + pieces_per_launch - 1) / pieces_per_launch;
  return static_cast<int32_t>(std::min<int64_t>(launches, 8));
}

// Output tiles of 128 rows by `block_n` columns in an m x n GEMM, and the columns of work one SM
// does in a persistent GEMM of them: ceil(tiles / SMs) waves, each as long as one tile.
inline int64_t TileCount(int64_t m, int64_t n, int64_t block_n) {
  return (m + kGemmBlockM - 1) / kGemmBlockM * ((n + block_n - 1) / block_n);
}
inline int64_t WaveSpan(int64_t m, int64_t n, int64_t block_n, int sm_count) {
  return (TileCount(m, n, block_n) + sm_count - 1) / sm_count * block_n;
}
// Whether tiles `block_n` wide leave each SM 10% fewer columns than tiles `other_n` wide: the
// margin stands for the narrower or clustered tile's lower efficiency per column.
inline bool ShorterWaves(int64_t m, int64_t n, int64_t block_n, int64_t other_n, int sm_count) {
  return WaveSpan(m, n, block_n, sm_count) * 11 < WaveSpan(m, n, other_n, sm_count) * 10;
}

// Output tile width (GpuTuning.tile_n; 0 = by waves). A persistent GEMM runs
// ceil(tiles / SMs) waves, each as long as one tile, and a tile's time scales
// with its width, so the narrow tile wins where ceil(tiles_192 / SMs) * 192 is
// clearly below ceil(tiles_256 / SMs) * 256; the 10% margin stands for the
// narrow tile's lower efficiency per column. Measured: 8B qkv AG at M = 2048
// (2048 x 3072 per GPU, 192 tiles = 1.45 waves) 103.0 -> 86.6 us; where the rule
// keeps 256, forcing 192 was 2-4% slower (2x H200, 2026-11-30;
// docs/decisions/2026-11-30-tile-width-by-waves.md). The transposed weight, ours / XLA's
// time on one H200: Phi-3 out-proj dx 2048 x 3072 x 1536 (96 tiles of 256 on 132 SMs, 128 of
// 192) 1.28 -> 1.04, Phi-3 gate+up dx 2048 x 8192 x 3072 1.27 -> 1.01 (ping-pong 1.06)
// (docs/decisions/2026-12-03-narrow-tile-dx-and-f16-pingpong.md). Less than one wave of
// 128x256 tiles only above 1024 rows (fewer rows are latency-bound, not measured).
inline int32_t ChooseBlockN(const CommConfig& cfg, int64_t m, int64_t n, int sm_count) {
  if (cfg.tuning.tile_n != 0) return static_cast<int32_t>(cfg.tuning.tile_n);
  if (m <= 0 || n <= 0 || sm_count <= 0) return kGemmBlockN;
  if (m <= 1024 && TileCount(m, n, kGemmBlockN) < sm_count) return kGemmBlockN;
  return ShorterWaves(m, n, kGemmBlockNNarrow, kGemmBlockN, sm_count) ? kGemmBlockNNarrow : kGemmBlockN;
}

// The 2x1-cluster instances where N is a multiple of 160 and 1024 < M <= 2048, the shapes where
// 128x256 tiles leave most of a last wave idle (2048 x 5120: 2.4 waves): ping-pong 128x128 for
// the [K, N] weight, 128x160 for the transposed one. On one H200 (ours / XLA's time, in one run):
// ping-pong took the three forward shapes measured from 1.07-1.15x (128x160) to 0.97-1.10x (Qwen
// out-proj 1.15 -> 1.10, 70B qkv 1.07 -> 0.97, Qwen down 1.13 -> 1.09) and lost
// to it on the transposed weight (Qwen out-proj dx 1.11 vs 1.28); both lose elsewhere (partial
// column tiles; at M >= 4096 the smaller tile's cost per column)
// (docs/decisions/2026-12-01-gemm-instances.md). Fewer rows are not measured (one row tile leaves
// half of each cluster idle). GpuTuning.tile_n pins the 1x1 instances.
inline bool PreferClustered(DType dtype, bool b_kmajor, int64_t m, int64_t n) {
  return m > 1024 && m <= 2048 && n % kGemmBlockN160 == 0 &&
         HasGemmInstance(dtype, b_kmajor, b_kmajor ? kGemmBlockN160 : kGemmBlockN128, 2, !b_kmajor);
}

// Cooperative 128x320 tiles in 2x1 clusters (wide_tile_mainloop.cuh) where N is a multiple of
// 320 and M > 1024: up to 2048 rows where K >= 4096 ([K, N] weight) or 3584 (transposed, the
// shortest K measured); above 2048 rows where their waves are 10% shorter than those of the 1x1 tile ChooseBlockN picks
// (its margin). At 2048 x N = 5120 they fill 1.9 waves of 132 SMs (128 x 256: 2.4; ping-pong
// 128 x 128: 4.8 tiles per SM) and read 35-40% fewer L2 bytes per output than ping-pong 128x128;
// a short K loop exposes their epilogue (cooperative: the tensor cores idle while both warpgroups
// store). Kernel time under sustained load on one H200, ours / XLA's: 70B qkv 2048 x 8192 x 5120
// 1.061 -> 1.027, Qwen-14B down 2048 x 6912 x 5120 1.060 -> 1.028 (ping-pong 128x128 before); at
// K = 2560 ping-pong stays ahead by 1%. The transposed weight against 128x160 in 2x1 clusters:
// Qwen-14B out-proj dx 2048 x 5120 x 2560 1.076 -> 1.024, Qwen-14B qkv dx 2048 x 3584 x 5120
// 1.073 -> 1.038. At 4096 rows the Qwen-14B out-proj dx (4096 x 5120 x 2560: 2 waves against
// 128x256's 3) 1.186 -> 1.007; where the waves tie (4096 and 8192 rows at N = 5120) 128x256 is
// 2-3% ahead (docs/decisions/2026-12-03-wide-tile-128x320.md, 2026-12-03-instance-by-waves.md).
inline bool PreferWideTile(const CommConfig& cfg, DType dtype, bool b_kmajor, int64_t m, int64_t n, int64_t k,
                           int sm_count) {
  if (m <= 1024 || n % kGemmBlockN320 != 0 || !HasGemmInstance(dtype, b_kmajor, kGemmBlockN320, 2)) return false;
  if (m <= 2048) return k >= (b_kmajor ? 3584 : 4096);
  if (sm_count <= 0) return false;
  return ShorterWaves(m, n, kGemmBlockN320, ChooseBlockN(cfg, m, n, sm_count), sm_count);
}

// Cooperative 128x224 tiles in 1x1 clusters for the transposed weight (a backward's dx), bf16 and
// float16, where M > 1024, their waves are 10% shorter than those of the 1x1 tile ChooseBlockN picks
// and no longer than ping-pong 128x128's (after PreferWideTile and PreferClustered, before
// PreferPingpongByWaves): N = 6912 and 7168, 31 and 32 tiles of 224 columns, whose 128x256 tiles
// leave most of a last wave idle (2048 x 7168: 512 tiles fill 3.9 waves of 132 SMs; 448 of 128x256
// run 3.4 waves as 4). Ping-pong 128x128 ties its waves but does less work per column. CUPTI kernel
// time under sustained load on one H200, ours / XLA's, two runs: 8B down dx 2048 x 4096 x 7168
// 1.063 / 1.064 (ping-pong) -> 1.034 / 1.036, Qwen-14B down dx 2048 x 5120 x 6912 1.067 / 1.068 ->
// 1.034 / 1.032. With the [K, N] weight (B's 448-byte rows in 64-byte swizzle atoms) it lost:
// 2048 x 5120 x 3584 1.105 / 1.072 against 128x256's 1.049 / 1.053, 4096 x 5120 x 3584 1.107 /
// 1.103 against ping-pong's 1.034 / 1.032; that layout has no such instance
// (docs/decisions/2026-12-05-dx-tile-128x224.md).
inline bool PreferTile224(const CommConfig& cfg, DType dtype, bool b_kmajor, int64_t m, int64_t n, int sm_count) {
  if (m <= 1024 || sm_count <= 0 || !HasGemmInstance(dtype, b_kmajor, kGemmBlockN224, 1)) return false;
  return ShorterWaves(m, n, kGemmBlockN224, ChooseBlockN(cfg, m, n, sm_count), sm_count) &&
         WaveSpan(m, n, kGemmBlockN224, sm_count) <= WaveSpan(m, n, kGemmBlockN128, sm_count);
}

// Ping-pong 128x128 tiles in 2x1 clusters, either weight layout, bf16 and float16, where M > 1024
// and their waves are 10% shorter than those of the 1x1 tile ChooseBlockN picks (after
// PreferWideTile and PreferClustered): shapes whose 128x256 and 128x192 tiles leave much of a last
// wave idle, e.g. N = 3584, 6912, 7168. Kernel time under sustained load on one H200, ours /
// XLA's, 128x256 -> ping-pong: 8B down dx 2048 x 4096 x 7168 1.163 -> 1.072, Qwen-14B qkv
// 4096 x 5120 x 3584 1.110 -> 1.037 (docs/decisions/2026-12-03-instance-by-waves.md); float16's
// forward at 2048-4096 rows, eight shapes, 1.18 -> 1.06 median; its dx, nine shapes, 1.20 -> 1.07
// (docs/decisions/2026-12-03-narrow-tile-dx-and-f16-pingpong.md).
inline bool PreferPingpongByWaves(const CommConfig& cfg, DType dtype, bool b_kmajor, int64_t m, int64_t n,
                                  int sm_count) {
  if (m <= 1024 || sm_count <= 0 || !HasGemmInstance(dtype, b_kmajor, kGemmBlockN128, 2, true)) return false;
  return ShorterWaves(m, n, kGemmBlockN128, ChooseBlockN(cfg, m, n, sm_count), sm_count);
}

// Whether ping-pong 128x128 tiles keep their lead where the output is many waves of tiles and K is
// short (PreferPingpongShortK, FP8's kFp8PingpongMaxK), told by the GPU's peak DRAM bandwidth
// (GroupWorkspace.dram_gbps; 0: unknown, taken as the H200 the rule was tuned on). On one H200
// (4.8 TB/s) ping-pong won there; on one H100 SXM (3.35 TB/s; same SMs, clocks and L2) it lost to
// cooperative 128x256 at all ten bf16 / f16 shapes and both FP8 ones timed, by 6-15% of kernel
// time: 8192 x 2048 x 4096 bf16 179 -> 210 us against 180 -> 183 (H200 -> H100), FP8 16384 x 3072
// x 8192 536 -> 618 against 572 -> 571. cuBLAS moves the same way at 4096 rows and at K = 1536
// (non-cooperative 128x128 / 128x160 tiles on the H200, cooperative 128x256 / 256x128 on the H100).
// The bandwidth tells the two GPUs apart; it is not shown to be the cause: on the H100 ping-pong
// moved about as many DRAM bytes as 128x256 (DRAM 19-29% busy) while its L2 ran at 77-87% of peak
// throughput against 47-62% (docs/decisions/2026-12-05-pingpong-by-gpu.md). At 2048 rows, where
// the waves decide, ping-pong keeps its lead on both GPUs.
inline constexpr int kPingpongManyWavesMinDramGbps = 4000;
inline bool PingpongAtManyWaves(int dram_gbps) { return dram_gbps <= 0 || dram_gbps >= kPingpongManyWavesMinDramGbps; }

// Ping-pong 128x128 tiles in 2x1 clusters for the [K, N] weight where K <= 2048 and M > 2048 (before
// the wave rules): a short K loop makes the epilogue a large share of each tile, and ping-pong runs
// one warpgroup's epilogue under the other's MMAs where the cooperative tile idles its tensor cores
// while both warpgroups store. Kernel time under sustained load on one H200, ours / XLA's, 128x256
// -> ping-pong: K = 1536 (Phi-3 out-proj) at 4096 / 8192 / 16384 rows 1.077 / 1.073 / 1.087 ->
// 1.053 / 1.037 / 1.052, K = 2048 (8B out-proj) 1.047 / 1.040 / 1.070 -> 1.038 / 1.036 / 1.054;
// float16 16384 x 1536 x 3072 1.087 -> 1.052; at K = 2560 0.7% ahead, at K >= 3072 behind or tied
// (docs/decisions/2026-12-03-pingpong-short-k.md). The transposed weight and 2048 rows or fewer
// are not measured. Only where PingpongAtManyWaves: on an H100 128x256 wins these shapes.
inline bool PreferPingpongShortK(DType dtype, bool b_kmajor, int64_t m, int64_t k, int dram_gbps) {
  return !b_kmajor && m > 2048 && k > 0 && k <= 2048 && PingpongAtManyWaves(dram_gbps) &&
         HasGemmInstance(dtype, b_kmajor, kGemmBlockN128, 2, true);
}

// Ping-pong 128x192 tiles in 2x1 clusters, bf16 and float16 with the [K, N] weight and FP8 e4m3
// rows, where the GPU is below PingpongAtManyWaves' line (an H100, where ping-pong 128x128 runs
// into the L2's throughput) and M > 2048, if their waves are at most 5% longer than those of the
// cooperative tile the rule would run (`cooperative_block_n`: ChooseBlockN's, FP8's 128x256). The
// warpgroup's tile is 1.5x as wide as ping-pong 128x128's, so it reads 22% fewer L2 bytes per
// output, and its epilogue stays under the other warpgroup's MMAs, where cooperative tiles idle the
// tensor cores. Kernel time under sustained load on one H100 SXM, ours / XLA's, the rule before ->
// ping-pong 128x192: FP8 16384 x 3072 x 8192 1.053 -> 0.972, 8192 x 2048 x 4096 1.041 -> 0.977,
// 4096 x 3072 x 4608 1.115 -> 0.997; bf16 16384 x 1536 x 3072 1.037 -> 0.976, 16384 x 3072 x 8192
// 1.056 -> 1.028, 4096 x 5120 x 3584 1.142 (ping-pong 128x128) -> 1.011. Waves 12.5% longer lost
// (bf16 4096 x 2048 x 4096 1.033 -> 1.155), as did 2048 rows, where the waves are few, and FP8 at
// K >= 8192 (by 1.5-3.5%: a long K loop hides the cooperative epilogue), so FP8 asks it at K <=
// 4096 only; bf16 at K >= 4096 within 1% of 128x256
// (docs/decisions/2026-12-05-pingpong-128x192.md). Not measured on an H200. A backward's e5m2 rows
// ask it at K <= 4608 (kFp8E5m2Pingpong192MaxK).
inline bool PreferPingpong192(int64_t m, int64_t n, int32_t cooperative_block_n, int sm_count, int dram_gbps) {
  return !PingpongAtManyWaves(dram_gbps) && m > 2048 && sm_count > 0 &&
         WaveSpan(m, n, kGemmBlockNNarrow, sm_count) * 20 <= WaveSpan(m, n, cooperative_block_n, sm_count) * 21;
}

// The overlap GEMM instance of a call (GemmPlan.block_n, cluster_m, pingpong).
// GpuTuning.gemm_kernel forces one, for A/B measurements: an instance this build lacks for the
// dtype and weight layout is an error, never a silent fallback. kAuto: PreferPingpongShortK, else
// PreferWideTile, else PreferClustered, else PreferTile224, else PreferPingpong192, else
// PreferPingpongByWaves, else
// ChooseBlockN's choice (cluster 1x1).
// kDecode is no overlap instance: ag_matmul's tp = 1 branch runs the decode GEMM for it, and
// every other call rejects it here.
inline Status ChooseGemmInstance(const CommConfig& cfg, DType dtype, bool b_kmajor, int64_t m, int64_t n, int64_t k,
                                 int sm_count, int dram_gbps, GemmPlan* plan) {
  plan->cluster_m = 1;
  plan->pingpong = false;
  switch (static_cast<GemmKernel>(cfg.tuning.gemm_kernel)) {
    case GemmKernel::kAuto:
      if (cfg.tuning.tile_n == 0 && PreferPingpongShortK(dtype, b_kmajor, m, k, dram_gbps)) {
        plan->block_n = kGemmBlockN128;
        plan->cluster_m = 2;
        plan->pingpong = true;
      } else if (cfg.tuning.tile_n == 0 && PreferWideTile(cfg, dtype, b_kmajor, m, n, k, sm_count)) {
        plan->block_n = kGemmBlockN320;
        plan->cluster_m = 2;
      } else if (cfg.tuning.tile_n == 0 && PreferClustered(dtype, b_kmajor, m, n)) {
        plan->block_n = b_kmajor ? kGemmBlockN160 : kGemmBlockN128;
        plan->cluster_m = 2;
        plan->pingpong = !b_kmajor;
      } else if (cfg.tuning.tile_n == 0 && PreferTile224(cfg, dtype, b_kmajor, m, n, sm_count)) {
        plan->block_n = kGemmBlockN224;
      } else if (cfg.tuning.tile_n == 0 && HasGemmInstance(dtype, b_kmajor, kGemmBlockNNarrow, 2, true) &&
                 PreferPingpong192(m, n, ChooseBlockN(cfg, m, n, sm_count), sm_count, dram_gbps)) {
        plan->block_n = kGemmBlockNNarrow;
        plan->cluster_m = 2;
        plan->pingpong = true;
      } else if (cfg.tuning.tile_n == 0 && PreferPingpongByWaves(cfg, dtype, b_kmajor, m, n, sm_count)) {
        plan->block_n = kGemmBlockN128;
        plan->cluster_m = 2;
        plan->pingpong = true;
      } else {
        plan->block_n = ChooseBlockN(cfg, m, n, sm_count);
      }
      break;  // checked below too: a dtype without instances fails here, before any handshake
    case GemmKernel::k128x256: plan->block_n = kGemmBlockN; break;
    case GemmKernel::k128x192: plan->block_n = kGemmBlockNNarrow; break;
    case GemmKernel::k128x224: plan->block_n = kGemmBlockN224; break;
    case GemmKernel::k128x160Cluster2x1:
      plan->block_n = kGemmBlockN160;
      plan->cluster_m = 2;
      break;
    case GemmKernel::k128x128PingpongCluster2x1:
      plan->block_n = kGemmBlockN128;
      plan->cluster_m = 2;
      plan->pingpong = true;
      break;
    case GemmKernel::k128x320Cluster2x1:
      plan->block_n = kGemmBlockN320;
      plan->cluster_m = 2;
      break;
    case GemmKernel::k128x160PingpongCluster2x1:  // FP8 e5m2 rows only: HasGemmInstance says no
      plan->block_n = kGemmBlockN160;
      plan->cluster_m = 2;
      plan->pingpong = true;
      break;
    case GemmKernel::k128x192PingpongCluster2x1:
      plan->block_n = kGemmBlockNNarrow;
      plan->cluster_m = 2;
      plan->pingpong = true;
      break;
    case GemmKernel::kDecode:
      return Status::InvalidArgument(
          "flux_jax: GpuTuning.gemm_kernel='decode' runs the decode GEMM alone, in ag_matmul at tp = 1 only "
          "(for the decode path at tp > 1 pin Config.fused_path='decode')");
    default:
      return Status::InvalidArgument("flux_jax: unknown GpuTuning.gemm_kernel " +
                                     std::to_string(cfg.tuning.gemm_kernel));
  }
  if (!HasGemmInstance(dtype, b_kmajor, plan->block_n, plan->cluster_m, plan->pingpong)) {
    return Status::InvalidArgument(
        "flux_jax: this build has no overlap GEMM instance with 128x" + std::to_string(plan->block_n) + " tiles in " +
        std::to_string(plan->cluster_m) + "x1 clusters" + (plan->pingpong ? " (ping-pong)" : "") + " for " +
        DTypeName(dtype) + (b_kmajor ? " with the transposed weight" : " with a [K, N] weight") +
        (static_cast<GemmKernel>(cfg.tuning.gemm_kernel) == GemmKernel::kAuto ? "" : " (GpuTuning.gemm_kernel)"));
  }
  return Status::Ok();
}

// Ping-pong 128x160 tiles for e5m2 rows (a backward's dy) where they leave each SM 10% fewer
// columns than 128x128 tiles (ShorterWaves): at 2048 x 2560 outputs, 320 tiles of 128 columns take
// 3 rounds of the 132 SMs, 256 of 160 columns take 2. cuBLASLt picks 128x160 2x1 tiles there
// (nvjet_sm90_qrsss_128x160_128x5_2x1; docs/decisions/2026-12-04-fp8-dx-128x160.md).
inline bool PreferFp8Pingpong160(int64_t m, int64_t n, int sm_count) {
  return sm_count > 0 && ShorterWaves(m, n, kGemmBlockN160, kGemmBlockN128, sm_count);
}

// The FP8 GEMM instance (gemm_fp8_instance.cuh) for an m x k x n GEMM: ping-pong 128x128 tiles in
// 2x1 clusters (B multicast) below 8192 x 8192 outputs unless Fp8CooperativeByWaves, and at larger
// outputs where K <= 4096 and PingpongAtManyWaves, else cooperative 128x256 tiles in 1x1
// clusters; on a GPU below 4 TB/s of DRAM either gives way to ping-pong 128x192
// (PreferPingpong192). Measured on one H200 against cuBLASLt's FP8 GEMM in one run (ours /
// theirs): ping-pong won five of six shapes (2048 x 2560 x 5120 1.34 -> 1.18, 4096 x 3072 x 4608
// 1.28 -> 1.16, 8192 x 2048 x 4096 1.19 -> 1.15 against 128x256) and lost 8192^3 (1.09 vs 1.05)
// (docs/decisions/2026-12-01-gemm-instances.md); at 16384-row outputs it won at K = 3072 and 4096
// (1.04 against 1.09-1.11) and lost at K = 8192 (docs/decisions/2026-12-04-fp8-pingpong-at-short-k.md);
// on an H100 it lost at K = 3072 too, so there it needs outputs below 8192 x 8192 (PingpongAtManyWaves).
// e5m2 rows (a backward's dy) run ping-pong 2x1 at every size: 128x192 tiles where
// PreferPingpong192 says (K <= kFp8E5m2Pingpong192MaxK), else 128x160 where PreferFp8Pingpong160
// says, else 128x128. At 2048 rows or fewer, on a GPU below 4 TB/s of DRAM, either row format runs
// ping-pong 128x192 in place of the ping-pong tile where PreferFp8Pingpong192FewRows says; on such
// a GPU the ping-pong tile then gives way to 128x160 where PreferFp8Pingpong160EqualWaves says.
// GpuTuning.gemm_kernel forces one of the instances the row format has. The row scales come from
// `fp8` (the caller offsets them for launches that start below row 0 of x).
// Ping-pong at 8192 x 8192 outputs and more up to this K where PingpongAtManyWaves (below them
// unless Fp8CooperativeByWaves).
inline constexpr int64_t kFp8PingpongMaxK = 4096;
// e5m2 rows (dx = dy w^T) take ping-pong 128x192 where PreferPingpong192 says, up to this K (the
// largest measured). H100 SXM, ours / XLA's FP8 GEMM, M x N output, K deep, ping-pong 128x128 ->
// 128x192 where the rule now takes it: 16384 x 2048, K = 4096 1.111 -> 0.994; 4096 x 3072, K =
// 4608 1.069 -> 0.989; where PreferPingpong192 does not (waves more than 5% longer, 2048 rows) it
// lost 5-12% (4096 x 4096, K = 3072 1.028 -> 1.080), except 8192 x 2048, K = 4096 (1.100 ->
// 1.074) (docs/decisions/2026-12-06-fp8-e5m2-pingpong-128x192.md).
inline constexpr int64_t kFp8E5m2Pingpong192MaxK = 4608;

// At 2048 rows or fewer, where the FP8 rule runs a ping-pong tile (`pingpong_block_n`: 128, or 160
// for e5m2 rows where PreferFp8Pingpong160 says), ping-pong 128x192 where its waves give each SM no
// more columns than that tile's (WaveSpan), at any K, on GPUs below PingpongAtManyWaves' line (an
// H100). With the waves equal, the wider warpgroup tile reads 22% fewer L2 bytes per output, which
// the H100's L2 throughput rewards. CUPTI GEMM kernel time on one H100 SXM, ours / XLA's FP8 GEMM,
// ping-pong 128x128 -> 128x192 (M x N output, K deep): e4m3 2048 x 1536, K 4096 1.261 -> 1.086;
// 2048 x 3072, K 3072 / 4096 / 8192 1.114 / 1.134 / 1.054 -> 1.082 / 1.053 / 0.980; 2048 x 6144,
// K 4096 1.087 -> 0.963; e5m2 2048 x 3072, K 8192 1.047 -> 0.981. Where 128x192's waves are
// longer it lost or tied: 2048 x 5120 (5 x 128 columns against 4 x 192) 1.028 -> 1.130, e5m2 2048
// x 4096 (4 x 128 against 3 x 192) 1.033 -> 1.093, except e4m3 2048 x 4096, K 5120 (1.121 ->
// 1.095) (docs/decisions/2026-12-06-fp8-pingpong-128x192-at-2048-rows.md). Not measured on an H200.
inline bool PreferFp8Pingpong192FewRows(int64_t m, int64_t n, int32_t pingpong_block_n, int sm_count, int dram_gbps) {
  return !PingpongAtManyWaves(dram_gbps) && m > 0 && m <= 2048 && sm_count > 0 &&
         WaveSpan(m, n, kGemmBlockNNarrow, sm_count) <= WaveSpan(m, n, pingpong_block_n, sm_count);
}

// Where the FP8 rule runs ping-pong 128x128 or 128x192 (`pingpong_block_n`), either row format, on
// GPUs below PingpongAtManyWaves' line (an H100): ping-pong 128x160 where N is a multiple of 160
// and its waves give each SM no more columns (WaveSpan). At 5120 columns 160-column tiles make 4
// waves where 128-column ones make 5: the same columns per SM, 20% fewer L2 bytes per output than
// 128x128's, and cuBLASLt's pick there (nvjet_sm90_qqsss_128x160_128x5_2x1). CUPTI GEMM kernel
// time on one H100 SXM, ours / XLA's FP8 GEMM, the rule before -> 128x160 (M x N output, K deep):
// e4m3 2048 x 5120, K 2560 / 6912 / 8192 1.028 / 1.114 / 1.130 -> 0.994 / 1.008 / 1.008; 4096 x
// 5120, K 2560 / 6912 1.036 (128x192) / 1.166 -> 1.003 / 0.990; 8192 x 5120, K 2560 1.011 (128x192)
// -> 0.998; 1024 x 5120, K 8192 1.162 (128x192) -> 0.991; e5m2 2048 x 5120, K 3584 / 4096 / 6912
// 1.041 / 1.053 / 1.059 -> 0.983 / 1.008 / 0.981. With partial tiles it lost: 2048 x 4096, K 5120
// 1.107 -> 1.213 (docs/decisions/2026-12-06-fp8-pingpong-128x160-equal-waves.md). Not measured on
// an H200.
inline bool PreferFp8Pingpong160EqualWaves(int64_t m, int64_t n, int32_t pingpong_block_n, int sm_count,
                                           int dram_gbps) {
  return !PingpongAtManyWaves(dram_gbps) && sm_count > 0 && n % kGemmBlockN160 == 0 &&
         WaveSpan(m, n, kGemmBlockN160, sm_count) <= WaveSpan(m, n, pingpong_block_n, sm_count);
}

// Below 8192 x 8192 outputs: cooperative 128x256 at K >= 8192 where 128x256 tiles make at least
// 4 waves and give each SM no more columns than 128x128 tiles' waves (WaveSpan): the regime of
// the two shapes where it won, 8192^3 and 4096 x 8192 x 8192. CUPTI GEMM kernel time on one H200,
// ours / cuBLASLt's FP8 GEMM, 4096 x 8192 x 8192 (8 waves of 128x256 tiles, 16 of 128x128):
// cooperative 1.040x and 1.033x against ping-pong's 1.047x and 1.059x in two runs; at 2048 x 8192
// x 5120 (3 waves of 128x256 for 2.4 waves of work, 5 of 128x128 for 4.8) ping-pong 1.026x
// against cooperative's 1.20x (docs/decisions/2026-12-05-fp8-cooperative-by-waves.md).
inline constexpr int64_t kFp8CooperativeMinK = 8192;
inline bool Fp8CooperativeByWaves(int64_t m, int64_t n, int64_t k, int sm_count) {
  return sm_count > 0 && k >= kFp8CooperativeMinK && TileCount(m, n, kGemmBlockN) >= int64_t{4} * sm_count &&
         WaveSpan(m, n, kGemmBlockN, sm_count) <= WaveSpan(m, n, kGemmBlockN128, sm_count);
}
inline Status ChooseFp8GemmInstance(const CommConfig& cfg, const Fp8Operands& fp8, int64_t m, int64_t k, int64_t n,
                                    int sm_count, int dram_gbps, GemmPlan* plan) {
  const auto kernel = static_cast<GemmKernel>(cfg.tuning.gemm_kernel);
  const bool by_rule = kernel == GemmKernel::kAuto;
  const bool below_8192_squared = m * n < int64_t{8192} * 8192;
  const bool pingpong_by_shape = (below_8192_squared && !Fp8CooperativeByWaves(m, n, k, sm_count)) ||
                                 (k <= kFp8PingpongMaxK && PingpongAtManyWaves(dram_gbps));
  if (fp8.x_e5m2 && !by_rule && kernel != GemmKernel::k128x128PingpongCluster2x1 &&
      kernel != GemmKernel::k128x160PingpongCluster2x1 && kernel != GemmKernel::k128x192PingpongCluster2x1) {
    return Status::InvalidArgument(
        "flux_jax: e5m2 rows run the ping-pong FP8 instances 128x128, 128x160 and 128x192 only "
        "(GpuTuning.gemm_kernel: auto, 128x128_pp_c2x1, 128x160_pp_c2x1 or 128x192_pp_c2x1)");
  }
  const int64_t pingpong192_max_k = fp8.x_e5m2 ? kFp8E5m2Pingpong192MaxK : kFp8PingpongMaxK;
  const bool e5m2_pingpong160 = fp8.x_e5m2 && PreferFp8Pingpong160(m, n, sm_count);
  const bool pingpong192 =
      kernel == GemmKernel::k128x192PingpongCluster2x1 ||
      (by_rule && k <= pingpong192_max_k && PreferPingpong192(m, n, kGemmBlockN, sm_count, dram_gbps)) ||
      (by_rule && (pingpong_by_shape || fp8.x_e5m2) &&
       PreferFp8Pingpong192FewRows(m, n, e5m2_pingpong160 ? kGemmBlockN160 : kGemmBlockN128, sm_count, dram_gbps));
  if (pingpong192) {
    plan->block_n = kGemmBlockNNarrow;
    plan->cluster_m = 2;
    plan->pingpong = true;
  } else if (kernel == GemmKernel::k128x160PingpongCluster2x1 || (by_rule && e5m2_pingpong160)) {
    plan->block_n = kGemmBlockN160;
    plan->cluster_m = 2;
    plan->pingpong = true;
  } else if (kernel == GemmKernel::k128x128PingpongCluster2x1 || (by_rule && (pingpong_by_shape || fp8.x_e5m2))) {
    plan->block_n = kGemmBlockN128;
    plan->cluster_m = 2;
    plan->pingpong = true;
  } else if (by_rule || kernel == GemmKernel::k128x256) {
    plan->block_n = kGemmBlockN;
    plan->cluster_m = 1;
    plan->pingpong = false;
  } else {
    return Status::InvalidArgument(
        "flux_jax: FP8 operands run the FP8 GEMM instances only (GpuTuning.gemm_kernel: auto, 128x256, "
        "128x128_pp_c2x1, 128x160_pp_c2x1 or 128x192_pp_c2x1)");
  }
  if (by_rule && plan->pingpong && plan->block_n != kGemmBlockN160 &&
      PreferFp8Pingpong160EqualWaves(m, n, plan->block_n, sm_count, dram_gbps)) {
    plan->block_n = kGemmBlockN160;
  }
  plan->fp8 = true;
  plan->fp8_a_e5m2 = fp8.x_e5m2;
  plan->row_scale = fp8.row_scale;
  plan->col_scale = fp8.col_scale;
  return Status::Ok();
}

// Checks the FP8 form of a call can run on the GPU kernels: the overlap path (or the decode path,
// where the op has an FP8 one), the transposed weight, K a multiple of 16 (16-byte rows for TMA).
inline Status CheckFp8Call(const char* op, const CommConfig& cfg, bool w_transposed, int64_t k,
                           bool fp8_decode = false) {
  if (cfg.path != FusedPath::kOverlap && !(fp8_decode && cfg.path == FusedPath::kDecode)) {
    return Status::InvalidArgument(std::string("flux_jax: ") + op + " with FP8 operands runs the overlap path" +
                                   (fp8_decode ? " or the decode path" : "") + " only");
  }
  if (!w_transposed || k % 16 != 0) {
    return Status::InvalidArgument(std::string("flux_jax: ") + op +
                                   " with FP8 operands needs the transposed weight and per-rank K a multiple of 16 "
                                   "(got K=" +
                                   std::to_string(k) + ")");
  }
  return Status::Ok();
}

// When the pieces of the pushed ReduceScatter stage go (GpuTuning.rs_tile_signal;
// -1 = by shape). Tile counters raised right after each tile's stores (2) start
// the pushes while the launch still runs, which pays where the GEMM does little
// work per pushed byte (small per-rank K) and the stage is short; every tile's
// storing warp waits for its stores and each piece costs a stream wait, so on long
// stages the launch's end (0) is better. Measured on 2x H200 (2026-11-30, one
// process, 5-7 rounds each; docs/decisions/2026-11-30-rs-tile-signal.md), setting 2 against 0 at per-rank K = 2048
// (Llama-8B out-projection), by stage size (rows per rank x N x 2 bytes):
//   8 MiB (M = 2048): 0.95-0.99x in 4 A/Bs     16 MiB (4096): 0.92-0.97x in 6
//   32 MiB (8192):    0.96-1.00x in 6          64 MiB (16384): 0.95, 1.02, 1.05x
// At K >= 4096: 0.98-1.02x, within the +-3.5% that identical programs spread.
inline constexpr int64_t kRsTileSignalMaxK = 2048;
inline constexpr int64_t kRsTileSignalMaxStageBytes = int64_t{16} << 20;
inline int64_t ChooseRsTileSignal(const CommConfig& cfg, int64_t k_local, int64_t stage_bytes) {
  if (cfg.tuning.rs_tile_signal >= 0) return cfg.tuning.rs_tile_signal;
  return k_local <= kRsTileSignalMaxK && stage_bytes <= kRsTileSignalMaxStageBytes ? 2 : 0;
}

// Output tiles (kGemmBlockM x block_n) whose rows meet rows [row0, row1) of a launch:
// a TileSignal counter of that piece reaches kTileSignalLanes times this once the launch has written them.
inline uint64_t TilesTouchingRows(int64_t row0, int64_t row1, int64_t n, int32_t block_n) {
  if (row1 <= row0) return 0;
  const int64_t row_tiles = (row1 - 1) / kGemmBlockM - row0 / kGemmBlockM + 1;
  return static_cast<uint64_t>(row_tiles * ((n + block_n - 1) / block_n));
}

// Row tiles the overlap GEMM sweeps together across N (GpuTuning.tile_group_m, else by instance):
// 16 for the bf16 / f16 cooperative tiles 192 or more columns wide (128x192, 128x224, 128x256, 128x320 2x1)
// where the rows the GEMM reads in order (a rank's chunk; all of them at tp = 1) hold 16 row
// tiles, else 8. With 132 tiles in flight, 16 rows of 128x256 tiles span ~8 tile columns: about
// the fewest bytes of A and B per wave (rows x 128 = columns x 256 at 16 x 8); the wider the tile,
// the more a group of 8 over-reads B. Time per call at the power cap on one H200, groups of 16
// against 8 (serpentine on), 128x256: eight shapes at M = 8192-16384 0.1-1.0% faster (median
// 1.041 -> 1.034x XLA's); seven at M = 2048-4096, six 0.3-0.7% faster, one tied
// (docs/decisions/2026-12-04-tile-groups-of-16.md). 128x320 2x1 and 128x192 at M = 2048-4096,
// by kernel time: three shapes 1.5-1.8% faster, three within 0.4%
// (docs/decisions/2026-12-05-tile-groups-of-16-wide-tiles.md).
// FP8 e4m3 ping-pong 128x128: 16 too where B (k x n bytes) exceeds a third of the 50 MB L2, which
// then holds no whole B from one group's sweep to the next: half as many groups, half the B
// reads from HBM.
// CUPTI kernel time on one H200, ours / XLA's FP8 GEMM, groups of 16 against 8: 16384 x 3072 x
// 8192 1.037 vs 1.048x, 16384 x 4096 x 8192 1.037 vs 1.055x, 2048 x 8192 x 5120 1.023 vs 1.037x;
// where B fits (8 and 13.5 MiB) 1.028 vs 1.024x and 1.043 vs 1.035x
// (docs/decisions/2026-12-04-fp8-tile-groups-of-16.md). Not measured: the other instances.
inline constexpr int kWideTileGroupM = 16;
inline constexpr int64_t kFp8GroupOf16MinBBytes = int64_t{16} << 20;
inline int32_t TileGroupM(const CommConfig& cfg, const GemmPlan& plan, int64_t chunk_rows) {
  if (cfg.tuning.tile_group_m > 0) return static_cast<int32_t>(cfg.tuning.tile_group_m);
  const bool wide = !plan.fp8 && plan.block_n >= kGemmBlockNNarrow && !plan.pingpong;
  const bool fp8_large_b = plan.fp8 && !plan.fp8_a_e5m2 && plan.pingpong && plan.block_n == kGemmBlockN128 &&
                           plan.k * plan.n >= kFp8GroupOf16MinBBytes;
  return (wide || fp8_large_b) && chunk_rows >= int64_t{kWideTileGroupM} * kGemmBlockM ? kWideTileGroupM
                                                                                       : kDefaultTileGroupM;
}

// Serpentine tile order (flux_jax/tile_order.h) unless GpuTuning.tile_serpentine = 0: each group of
// row tiles starts on the columns of B its predecessor read last, still in L2. On one H200 it cut
// the HBM bytes read by 19% at 16384 x 3072 x 8192 and 8% at 8192^3 (ncu, one call from idle), and
// the time per call at the power cap by 0.1-0.7% on all eight large-M shapes measured
// (docs/decisions/2026-12-04-serpentine-tile-order.md).
inline bool TileSerpentine(const CommConfig& cfg) { return cfg.tuning.tile_serpentine != 0; }

// The GEMM plan both ops start from: D[m, n] = A @ op(w), tuning from the config (the tile group
// is set once the instance is chosen: TileGroupM).
inline GemmPlan BasePlan(int64_t m, int64_t n, int64_t k, const void* w, bool w_transposed, const CommConfig& cfg) {
  GemmPlan plan;
  plan.m = m;
  plan.n = n;
  plan.k = k;
  plan.b = w;
  plan.b_kmajor = w_transposed;
  plan.serpentine = TileSerpentine(cfg);
  return plan;
}

inline int32_t NumPieces(int64_t rows, int32_t piece_rows) {
  return static_cast<int32_t>((rows + piece_rows - 1) / piece_rows);
}

// Compute stream, start of every fused call of the group, one small kernel:
//   present[rank] = epoch on every peer (SM store over NVLink / IPC);
//   then wait (bounded) until every peer's present reaches epoch.
// After this no persistent GEMM of ours can hold the SMs while a peer is still
// stuck behind other work (e.g. an XLA collective that needs our SMs), and the
// peer has finished every earlier call, so its receive buffers are free.
inline Status PresenceHandshake(GroupWorkspace& ws, cudaStream_t stream, const CommConfig& cfg) {
  PresenceSignal signal;
  signal.signal = cfg.drop_rank != ws.rank;  // drop_rank: tests make a rank never show up
  for (int p = 0; p < ws.tp; ++p) {
    if (p != ws.rank) signal.peer_slot[p] = ws.peers[p].present + ws.rank;
  }
  return LaunchPresenceHandshake(stream, signal, ws.present, ws.tp, ws.Wait(cfg.timeout_us));
}

// Copy-engine push of `bytes` to a peer, then its flag = epoch on the same stream, so the
// flag lands after the data: an 8-byte copy from cells[1] (which holds the epoch on the comm
// stream). (A stream memory op, cuStreamWriteValue64, measured 1.5-7% slower per call on
// 2x H200, 2026-11-30.)
inline Status PushPiece(GroupWorkspace& ws, void* dst, const void* src, size_t bytes, uint64_t* peer_flag) {
  if (bytes) FLUX_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ws.comm));
  FLUX_CUDA_TRY(cudaMemcpyAsync(peer_flag, ws.cells + 1, sizeof(uint64_t), cudaMemcpyDeviceToDevice, ws.comm));
  return Status::Ok();
}

inline RowGate MakeGate(const GroupWorkspace& ws, const CommConfig& cfg, const uint64_t* flags, int32_t rows_per_chunk,
                        int32_t rows_per_piece, int32_t total_rows, int32_t skip_chunk, int32_t peer_of_chunk0,
                        int32_t site) {
  RowGate g;
  g.flags = flags;
  g.rows_per_chunk = rows_per_chunk;
  g.rows_per_piece = rows_per_piece;
  g.pieces_per_chunk = NumPieces(rows_per_chunk, rows_per_piece);
  g.total_rows = total_rows;
  g.skip_chunk = skip_chunk;
  g.peer_of_chunk0 = peer_of_chunk0;
  g.tp = ws.tp;
  g.site = site;
  g.ctx = ws.Wait(cfg.timeout_us);
  return g;
}

}  // namespace flux_jax::cuda
