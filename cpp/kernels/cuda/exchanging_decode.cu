// One call of an exchanging decode path (exchanging_decode.h).
//
// Parity: P and the staged rows go to the parity half b = epoch & 1 of this rank's slot area,
// which a peer's slot-area path (latency collectives, ag_matmul's decode push) writes in calls
// e+2, e+4, ... only: a peer that ran ahead to call e+1 writes the other half while this rank may
// still read P. The low-latency half b is rewritten at call e+2 at the earliest, after this rank's
// call e+1 waited for words its peers wrote after their call e (every rank waits for every peer).
#include "cuda_util.h"
#include "decode_gemm.h"
#include "exchanging_decode.h"
#include "workspace.h"

namespace flux_jax::cuda {

Status RunExchangingDecode(const ExchangingDecodeCall& c, const TpGroup& group, const CommConfig& cfg, cudaStream_t S) {
  const int tp = group.size, r = group.rank;
  const int device = group.ordinals[r];
  const size_t elt = DTypeBytes(c.dtype), x_elt = OperandBytes(c.dtype, c.fp8);
  const size_t out_bytes = static_cast<size_t>(c.reduced_rows * c.n) * elt;
  if (cfg.poison_outputs) FLUX_CUDA_TRY(cudaMemsetAsync(c.out, 0xFF, out_bytes, S));
  if (c.m == 0) return Status::Ok();
  const int64_t readable = DecodeRowsReadable(c.m);
  const bool stage_x = readable != c.m;
  const size_t part_bytes = static_cast<size_t>(c.m * c.n) * elt;  // P (n % 8 == 0: whole vectors)
  const size_t own_bytes = part_bytes + (stage_x ? static_cast<size_t>(readable * c.k) * x_elt : 0);
  const size_t ll_half = DecodeExchangeBytes(tp * c.reduced_rows, c.n);  // one block per sender
  GroupWorkspace* ws = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(AcquireWorkspace(group, 0, cfg, S, &ws, 2 * own_bytes, 2 * ll_half));
  ws->epoch += 1;  // every rank counts every fused call of the group: epochs agree
  const size_t ll_offset = (ws->epoch & 1) * (ws->ll_capacity / 2);    // >= ll_half
  char* own = ws->slots + (ws->epoch & 1) * (ws->slots_capacity / 2);  // >= own_bytes

  DecodeGemmPlan plan;
  plan.rows = c.m;
  plan.n = c.n;
  plan.k = c.k;
  plan.x = c.x;
  plan.x_rows_readable = c.m;
  if (stage_x) {  // rows past m are read (any values) and never stored
    void* staged = own + part_bytes;
    FLUX_CUDA_TRY(cudaMemcpyAsync(staged, c.x, static_cast<size_t>(c.m * c.k) * x_elt, cudaMemcpyDeviceToDevice, S));
    plan.x = staged;
    plan.x_rows_readable = readable;
  }
  plan.w = c.w;
  plan.d = own;  // P
  plan.alpha_ptr = ws->alpha;
  plan.fp8 = c.fp8.on;
  plan.row_scale = c.fp8.row_scale;  // predicated past row m: the staged tail is never scaled
  plan.col_scale = c.fp8.col_scale;
  DecodeExchange& e = plan.exchange;
  e.tp = tp;
  e.rank = r;
  e.reduced_rows = static_cast<int32_t>(c.reduced_rows);
  e.n = static_cast<int32_t>(c.n);
  e.all_reduce = c.all_reduce;
  e.partial = plan.d;
  e.out = c.out;
  e.recv = ws->ll + ll_offset;
  for (int q = 0; q < tp; ++q) {  // sender r's block of q's receive area
    if (q != r) e.peer_recv[q] = ws->peers[q].ll + ll_offset + DecodeExchangeBytes(r * c.reduced_rows, c.n);
  }
  e.signal_peers = cfg.drop_rank != r;
  e.ctx = ws->Wait(cfg.timeout_us);
  return RunDecodeGemm(plan, c.dtype, S, device, ws->sm_count);
}

}  // namespace flux_jax::cuda
