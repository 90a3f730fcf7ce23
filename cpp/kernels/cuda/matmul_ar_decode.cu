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
// of this rank's slot area (exchanging_decode.cu).
#include "decode_gemm.h"
#include "exchanging_decode.h"
#include "matmul_ar_decode.h"

namespace flux_jax::cuda {

bool MatmulArDecodeSupported(const MatmulArParams& p, const TpGroup& group) {
  return group.size >= 1 && group.size <= kDecodeMaxRanks && p.m <= limits::kDecodeArMaxRows &&
         group.size * p.m * p.n <= limits::kDecodeArMaxElements && HasDecodeGemm(p.dtype, p.w_transposed, p.m, p.fp8);
}

Status RunMatmulArDecode(const MatmulArParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t S) {
  const int tp = group.size;
  if (!MatmulArDecodeSupported(p, group)) {
    return Status::InvalidArgument(
        "flux_jax: matmul_ar's decode path takes bfloat16 with the untransposed weight "
        "(or float8_e4m3fn rows with the transposed weight), 1.." +
        std::to_string(kDecodeMaxRanks) + " ranks, 1.." + std::to_string(limits::kDecodeArMaxRows) +
        " rows and ranks x rows x N <= " + std::to_string(limits::kDecodeArMaxElements) +
        "; got m=" + std::to_string(p.m) + ", n=" + std::to_string(p.n) + ", " + std::to_string(tp) +
        " ranks (use fused_path=\"latency\")");
  }
  ExchangingDecodeCall c;
  c.x = p.x, c.w = p.w, c.out = p.out;
  c.m = p.m, c.k = p.k, c.n = p.n, c.dtype = p.dtype;
  c.fp8 = p.fp8;
  c.reduced_rows = p.m;
  c.all_reduce = true;
  return RunExchangingDecode(c, group, cfg, S);
}

}  // namespace flux_jax::cuda
