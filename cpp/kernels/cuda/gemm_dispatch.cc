// Picks the GEMM instance for a dtype, weight layout and tile width.
#include "gemm_plan.h"

namespace flux_jax::cuda {

Status RunGemm_bf16_nmajor(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_bf16_kmajor(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_f16_nmajor(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_f16_kmajor(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_bf16_nmajor_n192(const GemmPlan&, cudaStream_t, int, int);
Status Preload_RunGemm_bf16_nmajor();
Status Preload_RunGemm_bf16_kmajor();
Status Preload_RunGemm_f16_nmajor();
Status Preload_RunGemm_f16_kmajor();
Status Preload_RunGemm_bf16_nmajor_n192();

Status PreloadGemmKernels() {
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_nmajor());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_kmajor());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_f16_nmajor());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_nmajor_n192());
  return Preload_RunGemm_f16_kmajor();
}

Status RunGemm(const GemmPlan& plan, DType dtype, cudaStream_t stream, int device, int sm_count) {
  switch (dtype) {
    case DType::kBF16:
      if (plan.block_n == kGemmBlockNNarrow && HasNarrowTile(dtype, plan.b_kmajor)) {
        return RunGemm_bf16_nmajor_n192(plan, stream, device, sm_count);
      }
      return plan.b_kmajor ? RunGemm_bf16_kmajor(plan, stream, device, sm_count)
                           : RunGemm_bf16_nmajor(plan, stream, device, sm_count);
    case DType::kF16:
      return plan.b_kmajor ? RunGemm_f16_kmajor(plan, stream, device, sm_count)
                           : RunGemm_f16_nmajor(plan, stream, device, sm_count);
    case DType::kF32:
    case DType::kU8:
      break;
  }
  return Status::InvalidArgument(
      "flux_jax: the CUDA kernels take bfloat16 or float16 inputs (float32: use impl='xla')");
}

}  // namespace flux_jax::cuda
