// GEMM instance: float8_e4m3fn x float8_e4m3fn -> bfloat16 with row and column scales (see
// gemm_fp8_instance.cuh). One instance per file so the build parallelizes.
#include "gemm_fp8_instance.cuh"

namespace flux_jax::cuda {

using Fp8Bf16 = GemmInstanceFp8<cutlass::bfloat16_t>;

Status RunGemm_e4m3_bf16(const GemmPlan& plan, cudaStream_t stream, int device, int sm_count) {
  return RunFp8GemmInstance<Fp8Bf16>(plan, stream, device, sm_count);
}

Status Preload_RunGemm_e4m3_bf16() { return PreloadGemmInstance<Fp8Bf16>(); }

}  // namespace flux_jax::cuda
