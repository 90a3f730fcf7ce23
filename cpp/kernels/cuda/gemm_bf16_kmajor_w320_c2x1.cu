// GEMM instance: cutlass::bfloat16_t, B kmajor (the transposed weight of a backward pass),
// cooperative 128x320 tiles (two m64n160 MMAs per warpgroup, wide_tile_mainloop.cuh), clusters of
// 2 CTAs along M sharing B by TMA multicast.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_kmajor_w320_c2x1, GemmInstance<cutlass::bfloat16_t, true, kGemmBlockN320, 2>)
