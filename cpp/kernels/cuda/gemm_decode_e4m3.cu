// The decode path's FP8 GEMM instances: float8_e4m3fn rows and weight, bfloat16 out, 64 weight
// columns x 64 or 128 rows per tile (above 128 rows, two tiles of 128 per weight column tile).
#include "decode_gemm.cuh"

namespace flux_jax::cuda {

using DecodeGemmFp8x64 = DecodeGemmInstanceFp8<64>;
using DecodeGemmFp8x128 = DecodeGemmInstanceFp8<128>;

Status RunDecodeGemmFp8(const DecodeGemmPlan& plan, cudaStream_t stream, int device, int sm_count) {
  if (plan.row_scale == nullptr || plan.col_scale == nullptr) {
    return Status::InvalidArgument("flux_jax: the FP8 decode GEMM needs its row and column scales");
  }
  if (plan.rows <= 64) return RunDecodeGemmInstance<DecodeGemmFp8x64>(plan, stream, device, sm_count);
  return RunDecodeGemmInstance<DecodeGemmFp8x128>(plan, stream, device, sm_count);
}

Status PreloadDecodeGemmFp8Kernels() {
  FLUX_JAX_RETURN_IF_ERROR(PreloadDecodeGemmInstance<DecodeGemmFp8x64>());
  return PreloadDecodeGemmInstance<DecodeGemmFp8x128>();
}

}  // namespace flux_jax::cuda
