// matmul_rs's decode path (at most kDecodeExchangeMaxRows rows): one launch, the
// reduce-scatter done tile by tile by the GEMM's own epilogue.
//
// At decode M the GEMM streams a weight of tens of MB while its output is a
// few hundred KB, so a separate collective after it (the latency path) adds
// ~9.5 us of launch and NVLink round trips to a ~20-30 us GEMM. Here:
//
//   rank r, stream S (XLA's)
//   [x staged into whole row tiles, if rows % tile != 0: a TMA box past the
//    end of its tensor takes a slow path]
//   decode GEMM (decode_gemm.cuh), P = x @ w, one tile = 64 columns x all rows;
//   its epilogue, per tile (decode_exchange.cuh):
//     rows of q != r -> q.ll[b][r] as (data, epoch) words
//     out[rows of r] = sum over q in rank order of (q == r ? P : ll[b][q]),
//                      each word taken once it carries epoch e
//
// ll[b] is the parity half b = e & 1 of the low-latency area, P and the staged
// rows the parity half b of this rank's slot area (read by no peer; written by
// the peers' slot-area paths only in calls of the same parity, e+2 at the
// earliest, which cannot start before this rank's call e+1 has answered them).
#include "cuda_util.h"
#include "decode_gemm.h"
#include "matmul_rs_decode.h"
#include "workspace.h"

namespace flux_jax::cuda {
bool MatmulRsDecodeSupported(const MatmulRsParams& p, const TpGroup& group) {
  return group.size >= 2 && group.size <= kDecodeMaxRanks && p.m % group.size == 0 && p.m <= kDecodeExchangeMaxRows &&
         p.n <= limits::kDecodeRsMaxN && HasDecodeGemm(p.dtype, p.w_transposed, p.m);
}

Status RunMatmulRsDecode(const MatmulRsParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t S) {
  const int tp = group.size, r = group.rank;
  if (!MatmulRsDecodeSupported(p, group)) {
    return Status::InvalidArgument(
        "flux_jax: matmul_rs's decode path takes bfloat16, the untransposed weight, 2.." +
        std::to_string(kDecodeMaxRanks) + " ranks and at most " + std::to_string(kDecodeExchangeMaxRows) +
        " rows, divisible by the ranks; got m=" + std::to_string(p.m) + " (use fused_path=\"latency\")");
  }
  const int device = group.ordinals[r];
  const size_t elt = DTypeBytes(p.dtype);
  const int64_t rpr = p.m / tp;
  const size_t out_bytes = static_cast<size_t>(rpr * p.n) * elt;
  if (cfg.poison_outputs) FLUX_CUDA_TRY(cudaMemsetAsync(p.out, 0xFF, out_bytes, S));
  if (p.m == 0) return Status::Ok();
  const int64_t readable = DecodeRowsReadable(p.m);
  const bool stage_x = readable != p.m;
  const size_t part_bytes = static_cast<size_t>(p.m * p.n) * elt;  // P (n % 8 == 0: whole vectors)
  const size_t own_bytes = part_bytes + (stage_x ? static_cast<size_t>(readable * p.k) * elt : 0);
  const size_t ll_half = DecodeExchangeBytes(p.m, p.n);
  GroupWorkspace* ws = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(AcquireWorkspace(group, 0, cfg, S, &ws, 2 * own_bytes, 2 * ll_half));
  ws->epoch += 1;  // every rank counts every fused call of the group: epochs agree
  const size_t ll_offset = (ws->epoch & 1) * (ws->ll_capacity / 2);  // >= ll_half
  // P and the staged rows: this call's parity half of the slot area, which a peer's slot-area
  // path (latency collectives, ag_matmul's decode push) writes in calls e+2, e+4, ... only: a
  // peer that ran ahead to call e+1 writes the other half while this rank may still read P.
  char* own = ws->slots + (ws->epoch & 1) * (ws->slots_capacity / 2);  // >= own_bytes

  DecodeGemmPlan plan;
  plan.rows = p.m;
  plan.n = p.n;
  plan.k = p.k;
  plan.x = p.x;
  plan.x_rows_readable = p.m;
  if (stage_x) {  // rows past m are read (any values) and never stored
    void* staged = own + part_bytes;
    FLUX_CUDA_TRY(cudaMemcpyAsync(staged, p.x, static_cast<size_t>(p.m * p.k) * elt, cudaMemcpyDeviceToDevice, S));
    plan.x = staged;
    plan.x_rows_readable = readable;
  }
  plan.w = p.w;
  plan.d = own;  // P
  plan.alpha_ptr = ws->alpha;
  DecodeExchange& e = plan.exchange;
  e.tp = tp;
  e.rank = r;
  e.reduced_rows = static_cast<int32_t>(rpr);
  e.n = static_cast<int32_t>(p.n);
  e.partial = plan.d;
  e.out = p.out;
  e.recv = ws->ll + ll_offset;
  for (int q = 0; q < tp; ++q) {
    if (q != r) e.peer_recv[q] = ws->peers[q].ll + ll_offset + DecodeExchangeBytes(r * rpr, p.n);
  }
  e.signal_peers = cfg.drop_rank != r;
  e.ctx = ws->Wait(cfg.timeout_us);
  return RunDecodeGemm(plan, p.dtype, S, device, ws->sm_count);
}

}  // namespace flux_jax::cuda
