// matmul_rs's decode path (at most kDecodeMaxRows rows): one launch, the
// reduce-scatter done tile by tile by the GEMM's own epilogue.
//
// At decode M the GEMM streams a weight of tens of MB while its output is a
// few hundred KB, so a separate collective after it (the latency path) adds
// ~9.5 us of launch and NVLink round trips to a ~20-30 us GEMM. Here:
//
//   rank r, stream S (XLA's)
//   [x staged into whole row tiles, if rows % tile != 0: a TMA box past the
//    end of its tensor takes a slow path]
//   decode GEMM (decode_gemm.cuh), P[b] = x @ w, one tile = 64 columns x all rows;
//   its epilogue, per tile (decode_exchange.cuh):
//     rows of q != r -> q.recv[b][r]; fence.sys; q.flag[r][tile] = e
//     wait flag[q][tile] >= e for all q != r
//     out[rows of r] = sum over q in rank order of (q == r ? P[b] : recv[b][q])
//
// recv[b], P[b] and the staged rows live in the parity half b = e & 1 of the
// slot area and the flags are block_arrived rows indexed by sender: the same
// epochs and reuse argument as the latency collectives and ag_matmul's decode
// path (every call of every path waits, before it ends, for a flag of every
// peer raised by that peer's kernel of the same call).
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cuda_util.h"
#include "decode_gemm.h"
#include "matmul_rs_decode.h"
#include "workspace.h"

namespace flux_jax::cuda {
namespace {
constexpr int64_t kTileCols = 64;  // decode_gemm.cuh: 64 weight columns per tile

// Diagnostics only (tools/loop_anatomy.py): FLUX_JAX_DEBUG_RS_DECODE_NO_EXCHANGE=1 runs the GEMM
// without its exchange, so the output is never written (wrong results), to time the GEMM alone.
bool DebugNoExchange() {
  static const bool value = [] {
    const char* v = std::getenv("FLUX_JAX_DEBUG_RS_DECODE_NO_EXCHANGE");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return value;
}
}  // namespace

bool MatmulRsDecodeSupported(const MatmulRsParams& p, const TpGroup& group) {
  const int64_t tiles = (p.n + kTileCols - 1) / kTileCols;
  return group.size >= 2 && group.size <= kDecodeMaxRanks && p.m % group.size == 0 &&
         tiles <= kFlagsPerSender && HasDecodeGemm(p.dtype, p.w_transposed, p.m);
}

Status RunMatmulRsDecode(const MatmulRsParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t S) {
  const int tp = group.size, r = group.rank;
  if (!MatmulRsDecodeSupported(p, group)) {
    return Status::InvalidArgument(
        "flux_jax: matmul_rs's decode path takes bfloat16, the untransposed weight, 2.." +
        std::to_string(kDecodeMaxRanks) + " ranks, at most " + std::to_string(kDecodeMaxRows) + " rows and n <= " +
        std::to_string(kFlagsPerSender * kTileCols) + "; got m=" + std::to_string(p.m) + " n=" + std::to_string(p.n) +
        " (use fused_path=\"latency\")");
  }
  const int device = group.ordinals[r];
  const size_t elt = DTypeBytes(p.dtype);
  const int64_t rpr = p.m / tp;
  const size_t out_bytes = static_cast<size_t>(rpr * p.n) * elt;
  if (cfg.poison_outputs) FLUX_CUDA_TRY(cudaMemsetAsync(p.out, 0xFF, out_bytes, S));
  if (p.m == 0) return Status::Ok();
  const int64_t readable = DecodeRowsReadable(p.m);
  const bool stage_x = readable != p.m;
  const size_t part_bytes = static_cast<size_t>(p.m * p.n) * elt;  // recv and P each (n % 8 == 0: whole vectors)
  const size_t half_bytes = 2 * part_bytes + (stage_x ? static_cast<size_t>(readable * p.k) * elt : 0);
  GroupWorkspace* ws = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(AcquireWorkspace(group, 0, cfg, S, &ws, 2 * half_bytes));
  ws->epoch += 1;  // every rank counts every fused call of the group: epochs agree
  const size_t parity_offset = (ws->epoch & 1) * (ws->slots_capacity / 2);  // >= half_bytes
  char* half = ws->slots + parity_offset;

  DecodeGemmPlan plan;
  plan.rows = p.m;
  plan.n = p.n;
  plan.k = p.k;
  plan.x = p.x;
  plan.x_rows_readable = p.m;
  if (stage_x) {  // rows past m are read (any values) and never stored
    void* staged = half + 2 * part_bytes;
    FLUX_CUDA_TRY(cudaMemcpyAsync(staged, p.x, static_cast<size_t>(p.m * p.k) * elt, cudaMemcpyDeviceToDevice, S));
    plan.x = staged;
    plan.x_rows_readable = readable;
  }
  plan.w = p.w;
  plan.d = half + part_bytes;  // P
  plan.alpha_ptr = ws->alpha;
  DecodeExchange& e = plan.exchange;
  e.tp = tp;
  e.rank = r;
  e.rows_per_rank = static_cast<int32_t>(rpr);
  e.n = static_cast<int32_t>(p.n);
  e.partial = plan.d;
  e.out = p.out;
  e.recv = half;
  for (int q = 0; q < tp; ++q) {
    if (q == r) continue;
    e.peer_recv[q] = ws->peers[q].slots + parity_offset + static_cast<size_t>(r * rpr * p.n) * elt;
    e.peer_flag[q] = ws->peers[q].block_arrived + r * kFlagsPerSender;
  }
  e.my_flags = ws->block_arrived;
  e.flag_stride = kFlagsPerSender;
  e.signal_peers = cfg.drop_rank != r;
  e.ctx = ws->Wait(cfg.timeout_us);
  if (DebugNoExchange()) e.tp = 0;
  return RunDecodeGemm(plan, p.dtype, S, device, ws->sm_count);
}

}  // namespace flux_jax::cuda
