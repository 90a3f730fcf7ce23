// GEMM instance: cutlass::bfloat16_t, B kmajor (the transposed weight of a backward pass),
// 128x160 tiles (m64n160 MMA atoms, CuTe's extended shapes), clusters of 2 CTAs along M sharing
// B by TMA multicast (see gemm_instance.cuh): dx = dy w^T at shapes where 128x256 tiles leave
// most of a last wave idle (2048 x 2560: 160 tiles = 1.2 waves; 256 of 128x160 = 1.9), where
// op_common.h PreferClustered picks it or GpuTuning.gemm_kernel forces it.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_kmajor_n160_c2x1, GemmInstance<cutlass::bfloat16_t, true, kGemmBlockN160, 2>)
