// The decode path's GEMM instances: bfloat16, 64 weight columns x 64, 128 or 256 rows per tile.
// Above 128 rows ag_matmul's wide weights take one 256-row tile per weight column tile, the rest
// two tiles of 128 (docs/decisions/2026-12-03-decode-256-row-tile.md).
#include "decode_gemm.cuh"

namespace flux_jax::cuda {

using DecodeGemm64 = DecodeGemmInstance<cutlass::bfloat16_t, 64>;
using DecodeGemm128 = DecodeGemmInstance<cutlass::bfloat16_t, 128>;
// No exchanging epilogue: matmul_rs and matmul_ar take at most 128 decode rows.
using DecodeGemm256 = DecodeGemmInstance<cutlass::bfloat16_t, 256, /*kExchange=*/false>;

Status RunDecodeGemm(const DecodeGemmPlan& plan, DType dtype, cudaStream_t stream, int device, int sm_count) {
  if (dtype != DType::kBF16 || plan.rows < 1 || plan.rows > kDecodeMaxRows) {
    return Status::InvalidArgument("flux_jax: the decode GEMM gives bfloat16 and takes 1.." +
                                   std::to_string(kDecodeMaxRows) + " rows, got rows=" + std::to_string(plan.rows));
  }
  if (plan.fp8) return RunDecodeGemmFp8(plan, stream, device, sm_count);
  if (plan.rows <= 64) {
    return RunDecodeGemmInstance<DecodeGemm64>(plan, stream, device, sm_count);
  }
  if (UseDecodeRowTile256(plan.rows, plan.n, plan.exchange.tp > 0, sm_count)) {
    return RunDecodeGemmInstance<DecodeGemm256>(plan, stream, device, sm_count);
  }
  return RunDecodeGemmInstance<DecodeGemm128>(plan, stream, device, sm_count);
}

Status PreloadDecodeGemmKernels() {
  FLUX_JAX_RETURN_IF_ERROR(PreloadDecodeGemmInstance<DecodeGemm64>());
  FLUX_JAX_RETURN_IF_ERROR(PreloadDecodeGemmInstance<DecodeGemm128>());
  FLUX_JAX_RETURN_IF_ERROR(PreloadDecodeGemmInstance<DecodeGemm256>());
  return PreloadDecodeGemmFp8Kernels();
}

}  // namespace flux_jax::cuda
