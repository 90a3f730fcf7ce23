// GEMM instance: cutlass::bfloat16_t, B nmajor, 128x160 tiles (m64n160 MMA atoms, CuTe's extended
// shapes), clusters of 2 CTAs along M sharing B by TMA multicast (see gemm_instance.cuh): the
// tile count of shapes where 128x256 tiles leave most of a last wave idle (2048 x 5120: 320 tiles
// of 128x256 = 2.4 waves of 132 SMs; 512 of 128x160 = 3.9). Runs only where
// GpuTuning.gemm_kernel forces it (op_common.h, ChooseGemmInstance).
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE_CLUSTER(RunGemm_bf16_nmajor_n160_c2x1, cutlass::bfloat16_t, false, kGemmBlockN160, 2)
