// GEMM instance: cutlass::bfloat16_t, B nmajor, 128x256 tiles, clusters of 2 CTAs along M that
// share each B tile by TMA multicast (see gemm_instance.cuh, gated_gemm.cuh): half the L2->SM
// traffic of B. Runs only where GpuTuning.gemm_kernel forces it (op_common.h, ChooseGemmInstance).
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE_CLUSTER(RunGemm_bf16_nmajor_c2x1, cutlass::bfloat16_t, false, kGemmBlockN, 2)
