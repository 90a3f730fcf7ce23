// AllGather -> GEMM on Hopper: one persistent CUTLASS GEMM whose producer warp
// waits for each remote row piece, fed by copy-engine pushes.
//
// Schedule (TP = 2, rank r; chunk = m_local rows; pieces P0..Pn of a chunk):
//
//   compute stream S (XLA's)             comm stream C (ours, high priority)
//   present handshake (wait for peers)
//                                        push x_r pieces -> peer gather buffer,
//   GEMM, tile rows rotated by rank:     each followed by peer.arrived[piece] = e
//     tiles of chunk r (read x_r         [x_r -> gathered[r], if requested]
//       directly, no wait)
//     tiles of chunk r+1 (producer waits arrived[piece] >= e, then TMA-loads A)
//   [remote chunks -> gathered, if requested; NaN if a wait gave up]
//   wait C (x_r must outlive the pushes)
//
// Pushes start as soon as the peer is present and overlap the local tiles;
// for TP > 2 rank r pushes to r-1 first (the rank that needs chunk r soonest).
#include "ag_matmul_decode.h"
#include "flux_jax/ag_matmul.h"
#include "op_common.h"

namespace flux_jax {

Status RunAgMatmulCuda(const AgMatmulParams& p, const TpGroup& group, const CommConfig& cfg, void* stream_ptr) {
  using namespace cuda;
  FLUX_JAX_RETURN_IF_ERROR(AgMatmulCanImplement(p, group));
  auto S = static_cast<cudaStream_t>(stream_ptr);
  const int tp = group.size, r = group.rank;
  const int device = group.ordinals[r];
  DeviceGuard guard(device);
  if (p.fp8.on) FLUX_JAX_RETURN_IF_ERROR(CheckFp8Call("ag_matmul", cfg, p.w_transposed, p.k, /*fp8_decode=*/true));
  if (cfg.path == FusedPath::kDecode && tp > 1) return RunAgMatmulDecode(p, group, cfg, S);
  const int64_t rows = tp * p.m_local;
  const size_t row_bytes = static_cast<size_t>(p.k) * OperandBytes(p.dtype, p.fp8);
  const size_t chunk_bytes = static_cast<size_t>(p.m_local) * row_bytes;
  // The GEMM instance (by shape, forced by the tuning, or the FP8 one), then its tile group over
  // a rank's chunk of rows.
  auto choose = [&](const GroupWorkspace& ws, GemmPlan* plan) {
    FLUX_JAX_RETURN_IF_ERROR(
        p.fp8.on ? ChooseFp8GemmInstance(cfg, p.fp8, rows, p.k, p.n, ws.sm_count, ws.dram_gbps, plan)
                 : ChooseGemmInstance(cfg, p.dtype, p.w_transposed, rows, p.n, p.k, ws.sm_count, ws.dram_gbps, plan));
    plan->group_m_tiles = TileGroupM(cfg, *plan, p.m_local);
    return Status::Ok();
  };
  if (cfg.poison_outputs) {
    FLUX_CUDA_TRY(cudaMemsetAsync(p.out, 0xFF, rows * p.n * DTypeBytes(p.dtype), S));
    if (p.gathered) FLUX_CUDA_TRY(cudaMemsetAsync(p.gathered, 0xFF, rows * row_bytes, S));
  }

  GemmPlan plan = BasePlan(rows, p.n, p.k, p.w, p.w_transposed, cfg);
  plan.d = p.out;

  if (tp == 1) {
    if (cfg.tuning.gemm_kernel == static_cast<int64_t>(GemmKernel::kDecode) && !p.fp8.on)
      return RunDecodeGemmAlone(p, group, cfg, S);
    GroupWorkspace* ws = nullptr;  // no communication; the workspace only holds alpha
    FLUX_JAX_RETURN_IF_ERROR(AcquireWorkspace(group, 0, cfg, S, &ws));
    FLUX_JAX_RETURN_IF_ERROR(choose(*ws, &plan));
    plan.a = p.x;
    plan.alpha_ptr = ws->alpha;
    // No gate runs here (gate_a is empty: its wait returns before the first flag). The probe
    // (A/B measurements only) gates every tile's A loads on flags that already hold the
    // epoch (0), so each wait is the one poll and the proxy fence a tile of a peer's rows
    // pays at tp > 1 once its piece is there: the gate's cost, without peers.
    if (cfg.tuning.gate_probe) {
      const int32_t piece_rows = PieceRows(rows, row_bytes, cfg.tuning.piece_bytes, kGemmBlockM * plan.cluster_m);
      plan.gate_a = MakeGate(*ws, cfg, ws->arrived, static_cast<int32_t>(rows), piece_rows, static_cast<int32_t>(rows),
                             -1, 0, kSiteGemmA);
      plan.gate_a.ctx.epoch = 0;
    }
    FLUX_JAX_RETURN_IF_ERROR(RunGemm(plan, p.dtype, S, device, ws->sm_count));
    if (p.gathered) FLUX_CUDA_TRY(cudaMemcpyAsync(p.gathered, p.x, chunk_bytes, cudaMemcpyDeviceToDevice, S));
    return Status::Ok();
  }

  GroupWorkspace* ws = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(AcquireWorkspace(group, rows * row_bytes, cfg, S, &ws));
  FLUX_JAX_RETURN_IF_ERROR(choose(*ws, &plan));
  ws->epoch += 1;
  const uint64_t epoch = ws->epoch;
  const int32_t piece_rows = PieceRows(p.m_local, row_bytes, cfg.tuning.piece_bytes, kGemmBlockM * plan.cluster_m);
  const int32_t pieces = NumPieces(p.m_local, piece_rows);
  auto x = static_cast<const char*>(p.x);

  const bool aligned = p.m_local % kGemmBlockM == 0;  // else a tile would straddle chunks
  FLUX_JAX_RETURN_IF_ERROR(PresenceHandshake(*ws, S, cfg));
  FLUX_CUDA_TRY(cudaEventRecord(ws->ev_start, S));

  // Comm stream: push my chunk, piece by piece, to every peer.
  FLUX_CUDA_TRY(cudaStreamWaitEvent(ws->comm, ws->ev_start, 0));
  FLUX_JAX_RETURN_IF_ERROR(StreamWriteValue64(ws->comm, ws->cells + 1, epoch));
  for (int i = 1; i < tp && cfg.drop_rank != r; ++i) {  // drop_rank (tests): sends neither data nor flags
    const int peer = (r - i + tp) % tp;
    for (int j = 0; j < pieces; ++j) {
      const int64_t row0 = static_cast<int64_t>(j) * piece_rows;
      const size_t bytes = static_cast<size_t>(std::min<int64_t>(piece_rows, p.m_local - row0)) * row_bytes;
      FLUX_JAX_RETURN_IF_ERROR(PushPiece(*ws, ws->peers[peer].data + (r * p.m_local + row0) * row_bytes,
                                         x + row0 * row_bytes, bytes, ws->peers[peer].arrived + r * pieces + j));
    }
  }
  // The gathered output (training keeps it for dW): its local chunk is ready now, so the copy
  // engine copies it next to the GEMM instead of after it (half of the copy off the critical
  // path at TP = 2). The remote chunks are copied after the GEMM, which has waited for them
  // with bounded waits; a stream wait here could not be bounded.
  if (p.gathered && aligned) {
    FLUX_CUDA_TRY(cudaMemcpyAsync(static_cast<char*>(p.gathered) + r * chunk_bytes, x, chunk_bytes,
                                  cudaMemcpyDeviceToDevice, ws->comm));
  }
  FLUX_CUDA_TRY(cudaEventRecord(ws->ev_comm_done, ws->comm));

  // Compute stream: the GEMM over all rows, local rows first.
  if (!aligned) {  // gather local rows too
    FLUX_CUDA_TRY(cudaMemcpyAsync(ws->data + r * chunk_bytes, x, chunk_bytes, cudaMemcpyDeviceToDevice, S));
  } else {
    plan.a_local = p.x;
    plan.local_rows = static_cast<int32_t>(p.m_local);
    plan.local_first_tile = static_cast<int32_t>(r * p.m_local / kGemmBlockM);
  }
  plan.a = ws->data;
  plan.alpha_ptr = ws->alpha;
  plan.rotate_m_tiles = static_cast<int32_t>((r * p.m_local + kGemmBlockM - 1) / kGemmBlockM);
  plan.gate_a = MakeGate(*ws, cfg, ws->arrived, static_cast<int32_t>(p.m_local), piece_rows, static_cast<int32_t>(rows),
                         r, 0, kSiteGemmA);
  FLUX_JAX_RETURN_IF_ERROR(RunGemm(plan, p.dtype, S, device, ws->sm_count));

  if (p.gathered) {
    // The received rows, or NaN if a wait of this GEMM gave up (its alpha is NaN then): the rows it
    // waited for may be stale (an earlier call's) or torn, like the GEMM's output. Aligned, the
    // local chunk is already there (comm stream, above).
    const int64_t skip_lo = aligned ? static_cast<int64_t>(r * chunk_bytes) : 0;
    const int64_t skip_hi = aligned ? static_cast<int64_t>((r + 1) * chunk_bytes) : 0;
    FLUX_JAX_RETURN_IF_ERROR(LaunchCopyUnlessPoisoned(S, p.gathered, ws->data, static_cast<int64_t>(tp * chunk_bytes),
                                                      skip_lo, skip_hi, ws->alpha, ws->sm_count));
  }
  FLUX_CUDA_TRY(cudaStreamWaitEvent(S, ws->ev_comm_done, 0));
  return Status::Ok();
}

}  // namespace flux_jax
