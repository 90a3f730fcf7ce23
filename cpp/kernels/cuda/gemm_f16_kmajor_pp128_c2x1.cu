// GEMM instance: cutlass::half_t, B kmajor (the transposed weight), ping-pong 128x128 tiles in
// clusters of 2 CTAs along M sharing B by TMA multicast (see gemm_instance.cuh; op_common.h,
// ChooseGemmInstance): float16's dx where 128x256 tiles leave much of a last wave idle.
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_f16_kmajor_pp128_c2x1,
                              GemmInstance<cutlass::half_t, true, kGemmBlockN128, 2, true>)
