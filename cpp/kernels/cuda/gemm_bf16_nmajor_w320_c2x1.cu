// GEMM instance: cutlass::bfloat16_t, B nmajor (the [K, N] weight), cooperative 128x320 tiles (two
// m64n160 MMAs per warpgroup, wide_tile_mainloop.cuh; B in 64-byte swizzled rows), clusters of 2
// CTAs along M sharing B by TMA multicast.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_nmajor_w320_c2x1,
                              GemmInstance<cutlass::bfloat16_t, false, kGemmBlockN320, 2>)
