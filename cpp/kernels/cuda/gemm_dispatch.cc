// Picks the GEMM instance for a dtype, weight layout, tile width and cluster.
#include <string>

#include "gemm_plan.h"

namespace flux_jax::cuda {

#define FLUX_JAX_DECLARE_GEMM_INSTANCE(name)            \
  Status name(const GemmPlan&, cudaStream_t, int, int); \
  Status Preload_##name();

// gemm_<dtype>_<layout>.cu: every 16-bit instance of one element type and weight layout.
#define FLUX_JAX_DECLARE_GEMM_FAMILY(prefix)          \
  FLUX_JAX_DECLARE_GEMM_INSTANCE(prefix)              \
  FLUX_JAX_DECLARE_GEMM_INSTANCE(prefix##_n192)       \
  FLUX_JAX_DECLARE_GEMM_INSTANCE(prefix##_pp128_c2x1) \
  FLUX_JAX_DECLARE_GEMM_INSTANCE(prefix##_w320_c2x1)

FLUX_JAX_DECLARE_GEMM_FAMILY(RunGemm_bf16_nmajor)
FLUX_JAX_DECLARE_GEMM_FAMILY(RunGemm_bf16_kmajor)
FLUX_JAX_DECLARE_GEMM_FAMILY(RunGemm_f16_nmajor)
FLUX_JAX_DECLARE_GEMM_FAMILY(RunGemm_f16_kmajor)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_bf16_kmajor_n160_c2x1)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_f16_kmajor_n160_c2x1)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_bf16_kmajor_n224)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_f16_kmajor_n224)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_bf16_nmajor_pp192_c2x1)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_f16_nmajor_pp192_c2x1)
// gemm_fp8.cu
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_e4m3_bf16)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_e4m3_bf16_pp128_c2x1)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_e4m3_bf16_pp160_c2x1)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_e4m3_bf16_pp192_c2x1)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_e5m2_bf16_pp128_c2x1)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_e5m2_bf16_pp160_c2x1)
FLUX_JAX_DECLARE_GEMM_INSTANCE(RunGemm_e5m2_bf16_pp192_c2x1)

namespace {

using GemmRunner = Status (*)(const GemmPlan&, cudaStream_t, int, int);

struct GemmEntry {
  GemmRunner run = nullptr;
  Status (*preload)() = nullptr;
};
#define FLUX_JAX_GEMM_ENTRY(name) \
  GemmEntry { name, Preload_##name }

// The 16-bit instances of one element type and weight layout (HasGemmInstance).
struct GemmFamily {
  GemmEntry w256, w224, w192, w160_c2x1, pp128_c2x1, w320_c2x1;  // w224, w160_c2x1: K-major only
  GemmEntry pp192_c2x1;                                          // N-major only
};
#define FLUX_JAX_GEMM_FAMILY(prefix, w224, w160_c2x1, pp192_c2x1)                                     \
  GemmFamily {                                                                                        \
    FLUX_JAX_GEMM_ENTRY(prefix), w224, FLUX_JAX_GEMM_ENTRY(prefix##_n192), w160_c2x1,                 \
        FLUX_JAX_GEMM_ENTRY(prefix##_pp128_c2x1), FLUX_JAX_GEMM_ENTRY(prefix##_w320_c2x1), pp192_c2x1 \
  }

// [float16][B K-major]
const GemmFamily kGemmFamilies[2][2] = {
    {FLUX_JAX_GEMM_FAMILY(RunGemm_bf16_nmajor, GemmEntry{}, GemmEntry{},
                          FLUX_JAX_GEMM_ENTRY(RunGemm_bf16_nmajor_pp192_c2x1)),
     FLUX_JAX_GEMM_FAMILY(RunGemm_bf16_kmajor, FLUX_JAX_GEMM_ENTRY(RunGemm_bf16_kmajor_n224),
                          FLUX_JAX_GEMM_ENTRY(RunGemm_bf16_kmajor_n160_c2x1), GemmEntry{})},
    {FLUX_JAX_GEMM_FAMILY(RunGemm_f16_nmajor, GemmEntry{}, GemmEntry{},
                          FLUX_JAX_GEMM_ENTRY(RunGemm_f16_nmajor_pp192_c2x1)),
     FLUX_JAX_GEMM_FAMILY(RunGemm_f16_kmajor, FLUX_JAX_GEMM_ENTRY(RunGemm_f16_kmajor_n224),
                          FLUX_JAX_GEMM_ENTRY(RunGemm_f16_kmajor_n160_c2x1), GemmEntry{})},
};

Status RunFp8Gemm(const GemmPlan& plan, DType dtype, cudaStream_t stream, int device, int sm_count) {
  const bool wide = plan.block_n == kGemmBlockN && plan.cluster_m == 1 && !plan.pingpong;
  const bool pingpong = plan.cluster_m == 2 && plan.pingpong;
  const bool pp128 = pingpong && plan.block_n == kGemmBlockN128;
  const bool pp160 = pingpong && plan.block_n == kGemmBlockN160;
  const bool pp192 = pingpong && plan.block_n == kGemmBlockNNarrow;
  if (dtype != DType::kBF16 || !plan.b_kmajor || !(wide || pp128 || pp160 || pp192)) {
    return Status::InvalidArgument(
        "flux_jax: the FP8 GEMM instances are ping-pong 128x128, 128x160 and 128x192 (2x1 clusters), and for e4m3 "
        "rows 128x256 (1x1), transposed weight, bfloat16 out");
  }
  if (plan.fp8_a_e5m2) {
    if (wide) {
      return Status::InvalidArgument(
          "flux_jax: the e5m2 x e4m3 GEMM instances are ping-pong 128x128, 128x160 and 128x192 (2x1) only");
    }
    if (pp192) return RunGemm_e5m2_bf16_pp192_c2x1(plan, stream, device, sm_count);
    return pp160 ? RunGemm_e5m2_bf16_pp160_c2x1(plan, stream, device, sm_count)
                 : RunGemm_e5m2_bf16_pp128_c2x1(plan, stream, device, sm_count);
  }
  if (wide) return RunGemm_e4m3_bf16(plan, stream, device, sm_count);
  if (pp160) return RunGemm_e4m3_bf16_pp160_c2x1(plan, stream, device, sm_count);
  return pp192 ? RunGemm_e4m3_bf16_pp192_c2x1(plan, stream, device, sm_count)
               : RunGemm_e4m3_bf16_pp128_c2x1(plan, stream, device, sm_count);
}

}  // namespace

Status PreloadGemmKernels() {
  for (const auto& by_layout : kGemmFamilies) {
    for (const GemmFamily& f : by_layout) {
      for (const GemmEntry& e : {f.w256, f.w224, f.w192, f.w160_c2x1, f.pp128_c2x1, f.w320_c2x1, f.pp192_c2x1}) {
        if (e.preload != nullptr) FLUX_JAX_RETURN_IF_ERROR(e.preload());
      }
    }
  }
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_e4m3_bf16());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_e4m3_bf16_pp128_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_e4m3_bf16_pp160_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_e4m3_bf16_pp192_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_e5m2_bf16_pp128_c2x1());
  FLUX_JAX_RETURN_IF_ERROR(Preload_RunGemm_e5m2_bf16_pp192_c2x1());
  return Preload_RunGemm_e5m2_bf16_pp160_c2x1();
}

Status RunGemm(const GemmPlan& plan, DType dtype, cudaStream_t stream, int device, int sm_count) {
  if (plan.fp8) return RunFp8Gemm(plan, dtype, stream, device, sm_count);
  if (dtype != DType::kBF16 && dtype != DType::kF16) {
    return Status::InvalidArgument(
        "flux_jax: the CUDA kernels take bfloat16 or float16 inputs (float32: use impl='xla')");
  }
  if (!HasGemmInstance(dtype, plan.b_kmajor, plan.block_n, plan.cluster_m, plan.pingpong)) {
    return Status::InvalidArgument("flux_jax: no overlap GEMM instance with 128x" + std::to_string(plan.block_n) +
                                   " tiles in " + std::to_string(plan.cluster_m) + "x1 clusters" +
                                   (plan.pingpong ? " (ping-pong)" : "") + " for " + DTypeName(dtype) +
                                   (plan.b_kmajor ? " with the transposed weight" : ""));
  }
  const GemmFamily& family = kGemmFamilies[dtype == DType::kF16][plan.b_kmajor];
  const GemmEntry& e = plan.pingpong ? (plan.block_n == kGemmBlockNNarrow ? family.pp192_c2x1 : family.pp128_c2x1)
                       : plan.block_n == kGemmBlockN320    ? family.w320_c2x1
                       : plan.block_n == kGemmBlockN160    ? family.w160_c2x1
                       : plan.block_n == kGemmBlockN224    ? family.w224
                       : plan.block_n == kGemmBlockNNarrow ? family.w192
                                                           : family.w256;
  return e.run(plan, stream, device, sm_count);
}

}  // namespace flux_jax::cuda
