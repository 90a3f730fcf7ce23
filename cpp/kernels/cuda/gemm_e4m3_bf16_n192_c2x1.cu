// GEMM instance: float8_e4m3fn x float8_e4m3fn -> bfloat16 with row and column scales, cooperative
// 128x192 tiles in 2x1 clusters sharing B by TMA multicast (see gemm_fp8_instance.cuh;
// ChooseFp8GemmInstance).
#include "gemm_fp8_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_e4m3_bf16_n192_c2x1,
                              GemmInstanceFp8<cutlass::float_e4m3_t, cutlass::bfloat16_t, kGemmBlockNNarrow, 2>)
