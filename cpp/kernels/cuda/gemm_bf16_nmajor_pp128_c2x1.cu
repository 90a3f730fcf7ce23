// GEMM instance: cutlass::bfloat16_t, B nmajor, 128x128 tiles, ping-pong (each consumer warpgroup
// owns a tile; one's epilogue runs under the other's MMAs), clusters of 2 CTAs along M sharing B
// by TMA multicast (see gemm_instance.cuh; op_common.h, ChooseGemmInstance).
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_nmajor_pp128_c2x1,
                              GemmInstance<cutlass::bfloat16_t, false, kGemmBlockN128, 2, true>)
