// GEMM instance: float8_e5m2 x float8_e4m3fn -> bfloat16 with row and column scales, 128x128 tiles,
// ping-pong, in 2x1 clusters sharing B: the backward GEMMs' dy rows (e5m2) times the weight (e4m3)
// (see gemm_fp8_instance.cuh; ChooseFp8GemmInstance).
#include "gemm_fp8_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_e5m2_bf16_pp128_c2x1,
                              GemmInstanceFp8<cutlass::float_e5m2_t, cutlass::bfloat16_t, kGemmBlockN128, 2, true>)
