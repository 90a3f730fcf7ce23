// GEMM instance: cutlass::bfloat16_t, B nmajor, 2x1 cluster (B multicast; see gemm_instance.cuh).
// One instance per file so the build parallelizes.
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_nmajor_c2, cutlass::bfloat16_t, false, 2)
