// ag_matmul's decode path (at most kDecodeMaxRows = 256 rows in all): the rows
// pushed by SM stores, and a GEMM that streams the weight while they arrive.
//
// At decode M the GEMM reads a weight of tens of MB for a few hundred KB of
// rows, so a separate gather before it (the latency path) is pure waiting,
// ~9.5 us per call. Here the gather runs under the weight stream:
//
//   rank r, stream S (XLA's)
//   push kernel, blocks i < P:  x[slice i] -> G_q[b][chunk r][slice i] on every rank q
//                               (own G included; NVLink stores to peers; FP8: block 0
//                               also x's row scales -> S_q[b][chunk r]),
//                               bar.sync, one fence.acq_rel.sys; flag_q[r][i] = e
//                               on every rank q
//                               (above 128 rows: own copy + own flag first)
//     | programmatic launch: the GEMM starts while the pushes run
//   decode GEMM (decode_gemm.cuh): each CTA issues its first S stages of W
//     loads, waits flag[q][i] >= e for the senders q of its tile's rows (all
//     of them up to 128 rows; one warp, bounded), then loads its rows of G[b];
//     out = G[b] @ w (FP8: its epilogue scales rows by S[b], after the same waits)
//
// Above 128 rows (two row tiles) the tiles of this rank's own rows start once
// the local copy is flagged, while the peers' rows cross NVLink:
//
//   rank 0 of 2, 256 rows:   row tile 0 (own rows)    |wait local|==== GEMM ====|
//                            row tile 1 (rank 1 rows) |wait NVLink push ...|==== GEMM ====|
//   [gathered = G[b], if requested; NaN if a wait gave up]
//
// G[b] is the parity half b = e & 1 of the slot area, so it shares the latency
// collectives' reuse argument (latency_collectives.cu): a rank writes G[b] of
// call e+2 only after its call e+1 saw the peer's flags of e+1, which the peer
// raises in its push kernel e+1, launched after its GEMM e (the last reader of
// G[b]) finished. The push kernel is an ordinary launch for that reason; only
// the GEMM after it launches early. The flags are the latency collectives'
// block_arrived rows, indexed by sender, so both paths keep one epoch sequence.
#include <algorithm>

#include "ag_matmul_decode.h"
#include "cuda_util.h"
#include "decode_gemm.h"
#include "nvlink_stores.cuh"
#include "stream_ops.h"
#include "workspace.h"

namespace flux_jax::cuda {
namespace {

constexpr int kThreads = 512;
// Push blocks: one per 16 KiB of the chunk, and the GEMM's waiting warp polls
// tp * blocks flags, at most 64 (two per lane).
constexpr int64_t kBytesPerBlock = 16 << 10;
constexpr int kMaxGateFlags = 64;
constexpr int kMaxBlocks = 32;

struct PushArgs {
  const uint4* x;
  uint4* dst[kDecodeMaxRanks];      // chunk r of G[b] on rank q (own included)
  uint64_t* flag[kDecodeMaxRanks];  // block_arrived[r][.] on rank q
  const float* scales;              // FP8: x's row scales (block 0 pushes them), else null
  float* scale_dst[kDecodeMaxRanks];
  int32_t scale_count;
  int64_t chunk_vecs;
  int32_t tp, rank;
  bool signal_peers;  // false: debug_drop_rank (tests the timeout path): no rows, no flags to peers
  bool local_first;   // own copy and flag before the peers' (GEMM row tiles per sender)
  uint64_t epoch;
};

// FP8: block 0 copies x's row scales to rank q's scale area (before the block's flag to q).
__device__ __forceinline__ void PushScales(const PushArgs& a, int q) {
  if (a.scales == nullptr || blockIdx.x != 0) return;
  for (int i = threadIdx.x; i < a.scale_count; i += kThreads) a.scale_dst[q][i] = a.scales[i];
}

__global__ void __launch_bounds__(kThreads) PushRowsKernel(PushArgs a) {
  // The GEMM may launch now: it waits for our flags, not for our end.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  int64_t lo, hi;
  BlockRange(a.chunk_vecs, &lo, &hi);
  const auto load = [&](int64_t v) { return __ldg(a.x + v); };
  if (a.local_first) {
    // The GEMM's tiles of this rank's rows start as soon as the local copy is flagged.
    BatchedCopy<kThreads, /*kBatch=*/4>(lo, hi, load, [&](int64_t v, uint4 val) { a.dst[a.rank][v] = val; });
#pragma unroll
    for (int q = 0; q < kDecodeMaxRanks; ++q) {
      if (q == a.rank) PushScales(a, q);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      FenceAcqRelSys();  // no NVLink stores outstanding yet: cheap
      StoreRelaxedSys(a.flag[a.rank] + blockIdx.x, a.epoch);
    }
  }
  BatchedCopy<kThreads, /*kBatch=*/4>(lo, hi, load, [&](int64_t v, uint4 val) {
#pragma unroll
    for (int q = 0; q < kDecodeMaxRanks; ++q) {
      if (q >= a.tp || (a.local_first && q == a.rank)) continue;
      if (q == a.rank || a.signal_peers) a.dst[q][v] = val;  // drop_rank (tests): no data to peers either
    }
  });
#pragma unroll
  for (int q = 0; q < kDecodeMaxRanks; ++q) {  // compile-time indices: the tables stay in parameter space
    if (q >= a.tp || (a.local_first && q == a.rank)) continue;
    if (q == a.rank || a.signal_peers) PushScales(a, q);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    FenceAcqRelSys();  // one fence for the whole block (nvlink_stores.cuh)
#pragma unroll
    for (int q = 0; q < kDecodeMaxRanks; ++q) {
      if (q >= a.tp || (a.local_first && q == a.rank)) continue;
      if (q == a.rank || a.signal_peers) StoreRelaxedSys(a.flag[q] + blockIdx.x, a.epoch);
    }
  }
}

}  // namespace

bool AgMatmulDecodeSupported(const AgMatmulParams& p, const TpGroup& group) {
  return group.size >= 2 && group.size <= kDecodeMaxRanks &&
         HasDecodeGemm(p.dtype, p.w_transposed, group.size * p.m_local, p.fp8);
}

Status RunAgMatmulDecode(const AgMatmulParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t S) {
  const int tp = group.size, r = group.rank;
  if (!AgMatmulDecodeSupported(p, group)) {
    return Status::InvalidArgument(
        "flux_jax: ag_matmul's decode path takes bfloat16 with the untransposed weight "
        "(or float8_e4m3fn rows with the transposed weight), 2.." +
        std::to_string(kDecodeMaxRanks) + " ranks and at most " + std::to_string(kDecodeMaxRows) +
        " rows in all; got " + std::to_string(tp * p.m_local) + " rows (use fused_path=\"latency\")");
  }
  const int device = group.ordinals[r];
  const size_t elt = DTypeBytes(p.dtype), x_elt = OperandBytes(p.dtype, p.fp8);
  const int64_t rows = tp * p.m_local;
  const size_t chunk_bytes = static_cast<size_t>(p.m_local * p.k) * x_elt;  // 16-byte rows: whole vectors
  if (cfg.poison_outputs) {
    FLUX_CUDA_TRY(cudaMemsetAsync(p.out, 0xFF, rows * p.n * elt, S));
    if (p.gathered) FLUX_CUDA_TRY(cudaMemsetAsync(p.gathered, 0xFF, rows * p.k * x_elt, S));
  }
  // The GEMM reads whole row tiles of G[b] (DecodeRowsReadable): the tail past the gathered rows
  // is read, never used, and stays inside the parity half. FP8: the row scales S[b] (every
  // rank's, rank order) follow G[b], on a 128-byte line of their own.
  const size_t rows_bytes = std::max(tp * chunk_bytes, static_cast<size_t>(DecodeRowsReadable(rows) * p.k) * x_elt);
  const size_t scales_offset = (rows_bytes + 127) / 128 * 128;
  const size_t half_bytes =
      p.fp8.on ? scales_offset + (static_cast<size_t>(rows) * sizeof(float) + 127) / 128 * 128 : rows_bytes;
  GroupWorkspace* ws = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(AcquireWorkspace(group, 0, cfg, S, &ws, 2 * half_bytes));
  ws->epoch += 1;  // every rank counts every fused call of the group: epochs agree
  const size_t parity_offset = (ws->epoch & 1) * (ws->slots_capacity / 2);  // >= half_bytes, 128-byte aligned

  const int64_t want = (static_cast<int64_t>(chunk_bytes) + kBytesPerBlock - 1) / kBytesPerBlock;
  const int blocks = static_cast<int>(std::clamp<int64_t>(want, 1, std::min(kMaxBlocks, kMaxGateFlags / tp)));
  PushArgs a{};
  a.x = static_cast<const uint4*>(p.x);
  for (int q = 0; q < tp; ++q) {
    a.dst[q] = reinterpret_cast<uint4*>(ws->peers[q].slots + parity_offset + r * chunk_bytes);
    a.flag[q] = ws->peers[q].block_arrived + r * kMaxLatencyBlocks;
    a.scale_dst[q] = reinterpret_cast<float*>(ws->peers[q].slots + parity_offset + scales_offset) + r * p.m_local;
  }
  a.scales = p.fp8.on ? p.fp8.row_scale : nullptr;  // this rank's rows' (the FFI's decode-path form)
  a.scale_count = static_cast<int32_t>(p.m_local);
  a.chunk_vecs = static_cast<int64_t>(chunk_bytes / sizeof(uint4));
  a.tp = tp;
  a.rank = r;
  a.signal_peers = cfg.drop_rank != r;
  // Above one row tile (128 rows) a GEMM tile reads the rows of one or two senders only.
  a.local_first = rows > kDecodeExchangeMaxRows;
  a.epoch = ws->epoch;
  PushRowsKernel<<<blocks, kThreads, 0, S>>>(a);
  FLUX_CUDA_TRY(cudaGetLastError());

  DecodeGemmPlan plan;
  plan.rows = rows;
  plan.n = p.n;
  plan.k = p.k;
  plan.x = ws->slots + parity_offset;
  plan.x_rows_readable = DecodeRowsReadable(rows);
  plan.w = p.w;
  plan.d = p.out;
  plan.alpha_ptr = ws->alpha;
  plan.fp8 = p.fp8.on;
  if (p.fp8.on) {
    // Read by the epilogue of a tile after its producer's waits for the tile's senders (block 0's
    // flag among them): the scales of every row the tile stores have landed.
    plan.row_scale = reinterpret_cast<const float*>(ws->slots + parity_offset + scales_offset);
    plan.col_scale = p.fp8.col_scale;
  }
  plan.gate.flags = ws->block_arrived;
  plan.gate.senders = tp;
  plan.gate.blocks = blocks;
  plan.gate.stride = kMaxLatencyBlocks;
  plan.gate.rows_per_sender = static_cast<int32_t>(p.m_local);
  plan.gate.ctx = ws->Wait(cfg.timeout_us);
  plan.early_launch = cfg.tuning.decode_early_launch;
  FLUX_JAX_RETURN_IF_ERROR(RunDecodeGemm(plan, p.dtype, S, device, ws->sm_count));
  if (p.gathered) {  // NaN if a wait of the GEMM gave up: the rows of G[b] may be an earlier call's
    FLUX_JAX_RETURN_IF_ERROR(LaunchCopyUnlessPoisoned(S, p.gathered, plan.x, static_cast<int64_t>(tp * chunk_bytes), 0,
                                                      0, ws->alpha, ws->sm_count));
  }
  return Status::Ok();
}

Status RunDecodeGemmAlone(const AgMatmulParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t S) {
  const int64_t rows = group.size * p.m_local;
  if (group.size != 1 || !HasDecodeGemm(p.dtype, p.w_transposed, rows)) {
    return Status::InvalidArgument(
        "flux_jax: GpuTuning.gemm_kernel='decode' runs the decode GEMM alone: tp = 1, bfloat16, the untransposed "
        "weight and 1.." +
        std::to_string(kDecodeMaxRows) + " rows; got tp=" + std::to_string(group.size) + ", " + DTypeName(p.dtype) +
        (p.w_transposed ? " with the transposed weight" : "") + ", rows=" + std::to_string(rows));
  }
  const int device = group.ordinals[group.rank];
  const size_t elt = DTypeBytes(p.dtype);
  // Rows staged to whole row tiles (as matmul_rs's decode path does), so no TMA box runs past its
  // tensor's end (a slow path); rows past `rows` are read, never stored.
  const int64_t readable = DecodeRowsReadable(rows);
  const bool stage_x = readable != rows;
  GroupWorkspace* ws = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(
      AcquireWorkspace(group, 0, cfg, S, &ws, stage_x ? static_cast<size_t>(readable * p.k) * elt : 0));
  DecodeGemmPlan plan;
  plan.rows = rows;
  plan.n = p.n;
  plan.k = p.k;
  plan.x = p.x;
  plan.x_rows_readable = rows;
  if (stage_x) {
    FLUX_CUDA_TRY(cudaMemcpyAsync(ws->slots, p.x, static_cast<size_t>(rows * p.k) * elt, cudaMemcpyDeviceToDevice, S));
    plan.x = ws->slots;
    plan.x_rows_readable = readable;
  }
  plan.w = p.w;
  plan.d = p.out;
  plan.alpha_ptr = ws->alpha;  // no gate: nothing to wait for
  FLUX_JAX_RETURN_IF_ERROR(RunDecodeGemm(plan, p.dtype, S, device, ws->sm_count));
  if (p.gathered) {
    FLUX_CUDA_TRY(cudaMemcpyAsync(p.gathered, p.x, static_cast<size_t>(rows * p.k) * elt, cudaMemcpyDeviceToDevice, S));
  }
  return Status::Ok();
}

Status PreloadAgMatmulDecode() {
  cudaFuncAttributes attrs;
  FLUX_CUDA_TRY(cudaFuncGetAttributes(&attrs, PushRowsKernel));
  return PreloadDecodeGemmKernels();
}

}  // namespace flux_jax::cuda
