// matmul_ar's decode path (at most kDecodeArMaxRows rows): one launch, a one-shot
// all-reduce done tile by tile by the GEMM's own epilogue.
//
// At decode M the GEMM streams a weight of tens of MB while its output is a few
// hundred KB; the overlap and latency paths run the all_reduce kernel after the
// GEMM (one more launch and NVLink round trip). Here:
//
//   rank r, stream S (XLA's)
//   [x staged into whole row tiles, if rows % tile != 0: a TMA box past the
//    end of its tensor takes a slow path]
//   decode GEMM (decode_gemm.cuh), P = x @ w, one tile = 64 columns x all rows;
//   its epilogue, per tile (decode_exchange.cuh, all_reduce):
//     all rows          -> q.ll[b][r] as (data, epoch) words, every q != r
//     out[all rows]     = sum over q in rank order of (q == r ? P : ll[b][q]),
//                         each word taken once it carries epoch e
//
// Every rank sums the same tp partials in the same order, so out is bitwise the
// same on every rank. ll[b] is the parity half b = e & 1 of the low-latency area,
// tp blocks of all rows (one per sender); P and the staged rows the parity half b
// of this rank's slot area (read by no peer). Reuse one parity later is safe as in
// matmul_rs's decode path: every rank's call waits for every peer's words.
#include "cuda_util.h"
#include "decode_gemm.h"
#include "matmul_ar_decode.h"
#include "workspace.h"

namespace flux_jax::cuda {

bool MatmulArDecodeSupported(const MatmulArParams& p, const TpGroup& group) {
  return group.size >= 1 && group.size <= kDecodeMaxRanks && p.m <= limits::kDecodeArMaxRows &&
         group.size * p.m * p.n <= limits::kDecodeArMaxElements && HasDecodeGemm(p.dtype, p.w_transposed, p.m);
}

Status RunMatmulArDecode(const MatmulArParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t S) {
  const int tp = group.size, r = group.rank;
  if (!MatmulArDecodeSupported(p, group)) {
    return Status::InvalidArgument("flux_jax: matmul_ar's decode path takes bfloat16, the untransposed weight, 1.." +
                                   std::to_string(kDecodeMaxRanks) + " ranks, 1.." +
                                   std::to_string(limits::kDecodeArMaxRows) +
                                   " rows and ranks x rows x N <= " + std::to_string(limits::kDecodeArMaxElements) +
                                   "; got m=" + std::to_string(p.m) + ", n=" + std::to_string(p.n) + ", " +
                                   std::to_string(tp) + " ranks (use fused_path=\"latency\")");
  }
  const int device = group.ordinals[r];
  const size_t elt = DTypeBytes(p.dtype);
  const size_t out_bytes = static_cast<size_t>(p.m * p.n) * elt;
  if (cfg.poison_outputs) FLUX_CUDA_TRY(cudaMemsetAsync(p.out, 0xFF, out_bytes, S));
  if (p.m == 0) return Status::Ok();
  const int64_t readable = DecodeRowsReadable(p.m);
  const bool stage_x = readable != p.m;
  const size_t part_bytes = out_bytes;  // P (n % 8 == 0: whole vectors)
  const size_t own_bytes = part_bytes + (stage_x ? static_cast<size_t>(readable * p.k) * elt : 0);
  const size_t ll_half = DecodeExchangeBytes(tp * p.m, p.n);
  GroupWorkspace* ws = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(AcquireWorkspace(group, 0, cfg, S, &ws, 2 * own_bytes, 2 * ll_half));
  ws->epoch += 1;  // every rank counts every fused call of the group: epochs agree
  const size_t ll_offset = (ws->epoch & 1) * (ws->ll_capacity / 2);    // >= ll_half
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
  e.reduced_rows = static_cast<int32_t>(p.m);
  e.n = static_cast<int32_t>(p.n);
  e.all_reduce = true;
  e.partial = plan.d;
  e.out = p.out;
  e.recv = ws->ll + ll_offset;
  for (int q = 0; q < tp; ++q) {
    if (q != r) e.peer_recv[q] = ws->peers[q].ll + ll_offset + DecodeExchangeBytes(r * p.m, p.n);
  }
  e.signal_peers = cfg.drop_rank != r;
  e.ctx = ws->Wait(cfg.timeout_us);
  return RunDecodeGemm(plan, p.dtype, S, device, ws->sm_count);
}

}  // namespace flux_jax::cuda
