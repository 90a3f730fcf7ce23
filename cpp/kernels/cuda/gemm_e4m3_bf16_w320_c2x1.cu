// GEMM instance: float8_e4m3fn x float8_e4m3fn -> bfloat16 with row and column scales, cooperative
// 128x320 tiles (two m64n160 MMAs per warpgroup, wide_tile_mainloop.cuh) in 2x1 clusters sharing
// B by TMA multicast (see gemm_fp8_instance.cuh; ChooseFp8GemmInstance).
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "gemm_fp8_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_e4m3_bf16_w320_c2x1,
                              GemmInstanceFp8<cutlass::float_e4m3_t, cutlass::bfloat16_t, kGemmBlockN320, 2>)
