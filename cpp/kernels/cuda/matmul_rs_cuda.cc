// GEMM -> ReduceScatter on Hopper: a ring of GEMM launches in which every
// partial sum is computed, pushed by the copy engine, and added by the next
// rank's GEMM epilogue (C load gated on arrival flags). No reduction kernel.
//
// Schedule of rank r, step j = 0 .. tp-1 (chunk c_j = r - j - 1 mod tp; m/tp rows):
//
//   j = 0      : S: stage[0] = x[c_0] @ w                 C: push stage[0] -> rank r+1
//   0 < j < tp-1: S: stage[j] = x[c_j] @ w + recv[j-1]     C: push stage[j] -> rank r+1
//   j = tp-1   : S: out      = x[r]   @ w + recv[tp-2]    (own rows: c = r)
//
// recv[j-1] is rank r-1's stage[j-1]; the epilogue waits per piece of rows.
// GpuTuning.rs_stage_launches splits stage 0 into launches of whole pieces, each
// pushed when it ends (S: [GEMM q0..q1) [GEMM q1..q2) ...; C: push q0..q1, ...),
// so the push starts after the first launch instead of the whole stage.
// GpuTuning.rs_tile_signal instead releases each piece of stage 0 as soon as its
// output tiles are written, inside one launch: the epilogue raises a per-piece
// tile counter (TileSignal) and C waits for it (cuStreamWaitValue64):
//
//   S: [GEMM stage 0 ......................][GEMM own rows + recv ..........]
//          tiles of piece 0 done ^   piece 1 ^   piece 2 ^   piece 3 ^
//   C:                        [wait|push 0][wait|push 1][wait|push 2][push 3]
//
// Those waits are on our own ungated GEMM, which always finishes, so they are
// safe unbounded.
// TP = 2: rank r computes the peer's rows, pushes them, then its own rows plus
// the peer's partial. Chunk c is summed in the fixed order c+1, c+2, ..., c:
// bitwise reproducible.
#include "flux_jax/matmul_rs.h"
#include "matmul_rs_decode.h"
#include "op_common.h"

namespace flux_jax {

Status RunMatmulRsCuda(const MatmulRsParams& p, const TpGroup& group, const CommConfig& cfg, void* stream_ptr) {
  using namespace cuda;
  FLUX_JAX_RETURN_IF_ERROR(MatmulRsCanImplement(p, group));
  auto S = static_cast<cudaStream_t>(stream_ptr);
  const int tp = group.size, r = group.rank;
  const int device = group.ordinals[r];
  DeviceGuard guard(device);
  if (p.fp8.on) FLUX_JAX_RETURN_IF_ERROR(CheckFp8Call("matmul_rs", cfg, p.w_transposed, p.k, /*fp8_decode=*/true));
  if (cfg.path == FusedPath::kDecode && tp > 1) return RunMatmulRsDecode(p, group, cfg, S);
  const size_t elt = DTypeBytes(p.dtype);  // out and the partial sums
  const size_t x_row_bytes = static_cast<size_t>(p.k) * OperandBytes(p.dtype, p.fp8);
  const int64_t m_out = p.m / tp;
  const size_t out_row_bytes = static_cast<size_t>(p.n) * elt;
  const size_t slot_bytes = static_cast<size_t>(m_out) * out_row_bytes;
  const size_t x_chunk_bytes = static_cast<size_t>(m_out) * x_row_bytes;
  if (cfg.poison_outputs) FLUX_CUDA_TRY(cudaMemsetAsync(p.out, 0xFF, slot_bytes, S));

  GemmPlan plan = BasePlan(m_out, p.n, p.k, p.w, p.w_transposed, cfg);
  const int64_t signal_mode = ChooseRsTileSignal(cfg, p.k, static_cast<int64_t>(slot_bytes));

  GroupWorkspace* ws = nullptr;
  // recv[0 .. tp-2] then stage[0 .. tp-2]
  FLUX_JAX_RETURN_IF_ERROR(AcquireWorkspace(group, 2 * (tp - 1) * slot_bytes, cfg, S, &ws));
  plan.alpha_ptr = ws->alpha;
  const int64_t gemm_rows = tp == 1 ? p.m : m_out;  // the rows each instance rule weighs
  if (p.fp8.on) {
    FLUX_JAX_RETURN_IF_ERROR(
        ChooseFp8GemmInstance(cfg, p.fp8, gemm_rows, p.k, p.n, ws->sm_count, ws->dram_gbps, &plan));
  } else {
    FLUX_JAX_RETURN_IF_ERROR(
        ChooseGemmInstance(cfg, p.dtype, p.w_transposed, gemm_rows, p.n, p.k, ws->sm_count, ws->dram_gbps, &plan));
  }
  // A stage's rows (or all of them at tp = 1) are the chunk its GEMM reads in order.
  const int32_t group_m = TileGroupM(cfg, plan, gemm_rows);
  plan.group_m_tiles = group_m;
  // FP8: the row scales of the launch's first row of x (row_scale covers all p.m rows).
  auto row_scales_at = [&](int64_t x_row) { return p.fp8.on ? p.fp8.row_scale + x_row : nullptr; };
  auto x = static_cast<const char*>(p.x);
  if (tp == 1) {
    plan.a = x;
    plan.d = p.out;
    return RunGemm(plan, p.dtype, S, device, ws->sm_count);
  }

  ws->epoch += 1;
  const uint64_t epoch = ws->epoch;
  const int32_t piece_rows = PieceRows(m_out, out_row_bytes, cfg.tuning.piece_bytes, kGemmBlockM * plan.cluster_m);
  const int32_t pieces = NumPieces(m_out, piece_rows);
  char* recv = ws->data;
  char* stage = ws->data + (tp - 1) * slot_bytes;
  const int next = (r + 1) % tp, prev = (r - 1 + tp) % tp;
  // Gated launches consume the received partial in row order: keep >= 4 tile
  // groups per launch so the first wave waits for a quarter of the chunk, not
  // all of it (one group of 8 row tiles at m/tp = 1024 made the whole push
  // exposed: 0.80x of the twin at 2048x4096x28672).
  const int32_t tiles_m = static_cast<int32_t>((m_out + kGemmBlockM - 1) / kGemmBlockM);
  const int32_t gated_group_m =
      cfg.tuning.tile_group_m > 0 ? group_m : std::max<int32_t>(1, std::min<int32_t>(group_m, tiles_m / 4));

  FLUX_JAX_RETURN_IF_ERROR(PresenceHandshake(*ws, S, cfg));
  for (int j = 0; j < tp; ++j) {
    const int chunk = (r - j - 1 + 2 * tp) % tp;
    const char* a_chunk = x + chunk * x_chunk_bytes;
    plan.row_scale = row_scales_at(chunk * m_out);
    char* d_slot = j == tp - 1 ? static_cast<char*>(p.out) : stage + j * slot_bytes;
    plan.group_m_tiles = j == 0 ? group_m : gated_group_m;
    if (j == 0) {
      plan.c = nullptr;
      plan.beta = 0.0f;
      plan.gate_c = RowGate{};
    } else {
      plan.c = recv + (j - 1) * slot_bytes;
      plan.beta = 1.0f;
      plan.gate_c = MakeGate(*ws, cfg, ws->arrived + (j - 1) * pieces, static_cast<int32_t>(m_out), piece_rows,
                             static_cast<int32_t>(m_out), -1, prev, kSiteEpilogueC);
    }
    if (j == tp - 1) {
      plan.a = a_chunk;
      plan.d = d_slot;
      FLUX_JAX_RETURN_IF_ERROR(RunGemm(plan, p.dtype, S, device, ws->sm_count));
      break;
    }
    // A pushed stage: each launch hands its pieces to rank r+1 as soon as it ends.
    // Only the ungated stage 0 is split (a gated one would need row-offset gates).
    const int32_t launches =
        j == 0 ? StageLaunches(cfg, m_out, p.n, plan.block_n, piece_rows, pieces, ws->sm_count) : 1;
    const int32_t pieces_per_launch = (pieces + launches - 1) / launches;
    for (int32_t q0 = 0; q0 < pieces; q0 += pieces_per_launch) {
      const int32_t q1 = std::min(pieces, q0 + pieces_per_launch);
      const int64_t row0 = static_cast<int64_t>(q0) * piece_rows;
      const int64_t row1 = std::min<int64_t>(m_out, static_cast<int64_t>(q1) * piece_rows);
      GemmPlan part = plan;
      part.m = row1 - row0;
      part.a = a_chunk + row0 * x_row_bytes;
      part.row_scale = row_scales_at(chunk * m_out + row0);
      part.d = d_slot + row0 * out_row_bytes;
      const bool tile_signal = j == 0 && signal_mode != 0;
      if (tile_signal) {
        part.signal_d =
            TileSignal{ws->tiles_done + q0, FastDivisor(piece_rows), static_cast<int32_t>(part.m), signal_mode == 2};
      }
      FLUX_JAX_RETURN_IF_ERROR(RunGemm(part, p.dtype, S, device, ws->sm_count));
      if (tile_signal) {  // the launch raises every piece's counter, whatever fails below
        for (int q = q0; q < q1; ++q) {
          const int64_t p0 = static_cast<int64_t>(q) * piece_rows - row0;
          ws->tiles_done_expected[q] +=
              kTileSignalLanes *
              TilesTouchingRows(p0, std::min<int64_t>(p0 + piece_rows, part.m), part.n, plan.block_n);
        }
      }

      if (!tile_signal) {
        // Reusing the event is safe: each wait takes the record enqueued just before it.
        FLUX_CUDA_TRY(cudaEventRecord(ws->ev_step[j], S));
        FLUX_CUDA_TRY(cudaStreamWaitEvent(ws->comm, ws->ev_step[j], 0));
      }
      if (j == 0 && q0 == 0) FLUX_JAX_RETURN_IF_ERROR(StreamWriteValue64(ws->comm, ws->cells + 1, epoch));
      for (int q = q0; q < q1 && cfg.drop_rank != r; ++q) {  // drop_rank (tests): sends neither data nor flags
        const int64_t p0 = static_cast<int64_t>(q) * piece_rows;
        const size_t bytes = static_cast<size_t>(std::min<int64_t>(piece_rows, m_out - p0)) * out_row_bytes;
        if (tile_signal) {
          FLUX_JAX_RETURN_IF_ERROR(StreamWaitValue64Geq(ws->comm, ws->tiles_done + q, ws->tiles_done_expected[q]));
        }
        FLUX_JAX_RETURN_IF_ERROR(PushPiece(*ws, ws->peers[next].data + j * slot_bytes + p0 * out_row_bytes,
                                           stage + j * slot_bytes + p0 * out_row_bytes, bytes,
                                           ws->peers[next].arrived + j * pieces + q));
      }
    }
  }
  FLUX_CUDA_TRY(cudaEventRecord(ws->ev_comm_done, ws->comm));
  FLUX_CUDA_TRY(cudaStreamWaitEvent(S, ws->ev_comm_done, 0));
  return Status::Ok();
}

}  // namespace flux_jax
