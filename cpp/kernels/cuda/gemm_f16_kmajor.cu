// GEMM instance: cutlass::half_t, B kmajor (see gemm_instance.cuh). One instance per file so
// the build parallelizes.
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_f16_kmajor, GemmInstance<cutlass::half_t, true, kGemmBlockN>)
