// GEMM instance: cutlass::bfloat16_t, B nmajor (see gemm_instance.cuh). One instance per file so
// the build parallelizes.
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_nmajor, GemmInstance<cutlass::bfloat16_t, false, kGemmBlockN>)
