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
// rows the parity half b of this rank's slot area (exchanging_decode.cu).
#include "decode_gemm.h"
#include "exchanging_decode.h"
#include "matmul_rs_decode.h"

namespace flux_jax::cuda {
bool MatmulRsDecodeSupported(const MatmulRsParams& p, const TpGroup& group) {
  return group.size >= 2 && group.size <= kDecodeMaxRanks && p.m % group.size == 0 && p.m <= kDecodeExchangeMaxRows &&
         p.n <= limits::kDecodeRsMaxN && HasDecodeGemm(p.dtype, p.w_transposed, p.m, p.fp8);
}

Status RunMatmulRsDecode(const MatmulRsParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t S) {
  const int tp = group.size;
  if (!MatmulRsDecodeSupported(p, group)) {
    return Status::InvalidArgument(
        "flux_jax: matmul_rs's decode path takes bfloat16 with the untransposed weight (or float8_e4m3fn rows "
        "with the transposed weight), 2.." +
        std::to_string(kDecodeMaxRanks) + " ranks and at most " + std::to_string(kDecodeExchangeMaxRows) +
        " rows, divisible by the ranks; got m=" + std::to_string(p.m) + " (use fused_path=\"latency\")");
  }
  ExchangingDecodeCall c;
  c.x = p.x, c.w = p.w, c.out = p.out;
  c.m = p.m, c.k = p.k, c.n = p.n, c.dtype = p.dtype;
  c.fp8 = p.fp8;
  c.reduced_rows = p.m / tp;
  return RunExchangingDecode(c, group, cfg, S);
}

}  // namespace flux_jax::cuda
