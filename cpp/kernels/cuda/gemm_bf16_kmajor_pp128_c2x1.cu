// GEMM instance: cutlass::bfloat16_t, B kmajor (the transposed weight), 128x128 tiles, ping-pong,
// clusters of 2 CTAs along M sharing B by TMA multicast (see gemm_bf16_nmajor_pp128_c2x1.cu).
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_kmajor_pp128_c2x1,
                              GemmInstance<cutlass::bfloat16_t, true, kGemmBlockN128, 2, true>)
