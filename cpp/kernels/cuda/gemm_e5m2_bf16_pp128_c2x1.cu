// GEMM instance: float8_e5m2 x float8_e4m3fn -> bfloat16 with row and column scales, 128x128 tiles,
// ping-pong, in 2x1 clusters sharing B: the backward GEMMs' dy rows (e5m2) times the weight (e4m3)
// (see gemm_fp8_instance.cuh; ChooseFp8GemmInstance).
#include "gemm_fp8_instance.cuh"

namespace flux_jax::cuda {

using E5m2Bf16Pp128C2x1 = GemmInstanceFp8<cutlass::bfloat16_t, kGemmBlockN128, 2, true, 1, cutlass::float_e5m2_t>;

Status RunGemm_e5m2_bf16_pp128_c2x1(const GemmPlan& plan, cudaStream_t stream, int device, int sm_count) {
  return RunFp8GemmInstance<E5m2Bf16Pp128C2x1>(plan, stream, device, sm_count);
}

Status Preload_RunGemm_e5m2_bf16_pp128_c2x1() { return PreloadGemmInstance<E5m2Bf16Pp128C2x1>(); }

}  // namespace flux_jax::cuda
