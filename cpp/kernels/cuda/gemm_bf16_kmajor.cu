// GEMM instance: cutlass::bfloat16_t, B kmajor (see gemm_instance.cuh). One instance per file so
// the build parallelizes.
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_kmajor, GemmInstance<cutlass::bfloat16_t, true, kGemmBlockN>)
