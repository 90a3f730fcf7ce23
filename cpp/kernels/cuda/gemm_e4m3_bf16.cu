// GEMM instance: float8_e4m3fn x float8_e4m3fn -> bfloat16 with row and column scales, cooperative
// 128x256 tiles (see gemm_fp8_instance.cuh). One instance per file so the build parallelizes.
#include "gemm_fp8_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_e4m3_bf16, GemmInstanceFp8<cutlass::float_e4m3_t, cutlass::bfloat16_t>)
