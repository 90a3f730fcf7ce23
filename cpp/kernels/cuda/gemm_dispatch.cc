// Picks the GEMM instance for a dtype, weight layout, tile width and cluster.
#include <string>

#include "gemm_plan.h"

namespace flux_jax::cuda {

Status RunGemm_bf16_nmajor(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_bf16_kmajor(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_f16_nmajor(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_f16_kmajor(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_bf16_nmajor_n192(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_bf16_kmajor_n192(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_bf16_kmajor_n160_c2x1(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_e4m3_bf16(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_bf16_nmajor_pp128_c2x1(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_bf16_kmajor_pp128_c2x1(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_f16_nmajor_pp128_c2x1(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_f16_kmajor_pp128_c2x1(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_e4m3_bf16_pp128_c2x1(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_e5m2_bf16_pp128_c2x1(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_bf16_nmajor_w320_c2x1(const GemmPlan&, cudaStream_t, int, int);
Status RunGemm_bf16_kmajor_w320_c2x1(const GemmPlan&, cudaStream_t, int, int);
Status Preload_RunGemm_bf16_nmajor();
Status Preload_RunGemm_bf16_kmajor();
Status Preload_RunGemm_f16_nmajor();
Status Preload_RunGemm_f16_kmajor();
Status Preload_RunGemm_bf16_nmajor_n192();
Status Preload_RunGemm_bf16_kmajor_n192();
Status Preload_RunGemm_bf16_kmajor_n160_c2x1();
Status Preload_RunGemm_e4m3_bf16();
Status Preload_RunGemm_bf16_nmajor_pp128_c2x1();
Status Preload_RunGemm_bf16_kmajor_pp128_c2x1();
Status Preload_RunGemm_f16_nmajor_pp128_c2x1();
Status Preload_RunGemm_f16_kmajor_pp128_c2x1();
Status Preload_RunGemm_e4m3_bf16_pp128_c2x1();
Status Preload_RunGemm_e5m2_bf16_pp128_c2x1();
Status Preload_RunGemm_bf16_nmajor_w320_c2x1();
Status Preload_RunGemm_bf16_kmajor_w320_c2x1();

Status PreloadGemmKernels() {
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_nmajor());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_kmajor());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_f16_nmajor());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_nmajor_n192());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_kmajor_n192());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_kmajor_n160_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_e4m3_bf16());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_nmajor_pp128_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_kmajor_pp128_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_f16_nmajor_pp128_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_f16_kmajor_pp128_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_e4m3_bf16_pp128_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_e5m2_bf16_pp128_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_nmajor_w320_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_bf16_kmajor_w320_c2x1());
  return Preload_RunGemm_f16_kmajor();
}

// The 2x1-cluster instances (ChooseGemmInstance): 128x160 (K-major B), ping-pong 128x128 and
// cooperative 128x320 (bf16), ping-pong 128x128 (f16, N-major B).
static Status RunClusteredGemm(const GemmPlan& plan, DType dtype, cudaStream_t stream, int device, int sm_count) {
  if (!HasGemmInstance(dtype, plan.b_kmajor, plan.block_n, plan.cluster_m, plan.pingpong)) {
    return Status::InvalidArgument("flux_jax: no overlap GEMM instance with 128x" + std::to_string(plan.block_n) +
                                   " tiles in " + std::to_string(plan.cluster_m) + "x1 clusters" +
                                   (plan.pingpong ? " (ping-pong)" : "") + " for " + DTypeName(dtype) +
                                   (plan.b_kmajor ? " with the transposed weight" : ""));
  }
  if (plan.pingpong) {
    if (dtype == DType::kF16) {
      return plan.b_kmajor ? RunGemm_f16_kmajor_pp128_c2x1(plan, stream, device, sm_count)
                           : RunGemm_f16_nmajor_pp128_c2x1(plan, stream, device, sm_count);
    }
    return plan.b_kmajor ? RunGemm_bf16_kmajor_pp128_c2x1(plan, stream, device, sm_count)
                         : RunGemm_bf16_nmajor_pp128_c2x1(plan, stream, device, sm_count);
  }
  if (plan.block_n == kGemmBlockN320) {
    return plan.b_kmajor ? RunGemm_bf16_kmajor_w320_c2x1(plan, stream, device, sm_count)
                         : RunGemm_bf16_nmajor_w320_c2x1(plan, stream, device, sm_count);
  }
  return RunGemm_bf16_kmajor_n160_c2x1(plan, stream, device, sm_count);
}

Status RunGemm(const GemmPlan& plan, DType dtype, cudaStream_t stream, int device, int sm_count) {
  if (plan.fp8) {
    const bool wide = plan.block_n == kGemmBlockN && plan.cluster_m == 1 && !plan.pingpong;
    const bool pingpong = plan.block_n == kGemmBlockN128 && plan.cluster_m == 2 && plan.pingpong;
    if (dtype != DType::kBF16 || !plan.b_kmajor || !(wide || pingpong)) {
      return Status::InvalidArgument(
          "flux_jax: the FP8 GEMM instances are 128x256 (1x1 clusters) and ping-pong 128x128 (2x1), transposed "
          "weight, bfloat16 out");
    }
    if (plan.fp8_a_e5m2) {
      if (!pingpong) {
        return Status::InvalidArgument("flux_jax: the e5m2 x e4m3 GEMM instance is ping-pong 128x128 (2x1) only");
      }
      return RunGemm_e5m2_bf16_pp128_c2x1(plan, stream, device, sm_count);
    }
    return wide ? RunGemm_e4m3_bf16(plan, stream, device, sm_count)
                : RunGemm_e4m3_bf16_pp128_c2x1(plan, stream, device, sm_count);
  }
  if (plan.cluster_m != 1 || plan.block_n == kGemmBlockN160 || plan.block_n == kGemmBlockN320 || plan.pingpong)
    return RunClusteredGemm(plan, dtype, stream, device, sm_count);
  switch (dtype) {
    case DType::kBF16:
      if (plan.block_n == kGemmBlockNNarrow) {
        return plan.b_kmajor ? RunGemm_bf16_kmajor_n192(plan, stream, device, sm_count)
                             : RunGemm_bf16_nmajor_n192(plan, stream, device, sm_count);
      }
      return plan.b_kmajor ? RunGemm_bf16_kmajor(plan, stream, device, sm_count)
                           : RunGemm_bf16_nmajor(plan, stream, device, sm_count);
    case DType::kF16:
      return plan.b_kmajor ? RunGemm_f16_kmajor(plan, stream, device, sm_count)
                           : RunGemm_f16_nmajor(plan, stream, device, sm_count);
    case DType::kF32:
    case DType::kU8: break;
  }
  return Status::InvalidArgument(
      "flux_jax: the CUDA kernels take bfloat16 or float16 inputs (float32: use impl='xla')");
}

}  // namespace flux_jax::cuda
