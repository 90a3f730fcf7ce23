// GEMM instance: cutlass::bfloat16_t, B kmajor (the transposed weight), cooperative 128x192 tiles
// in 2x1 clusters sharing B by TMA multicast (see gemm_instance.cuh; op_common.h
// ChooseGemmInstance).
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_kmajor_n192_c2x1,
                              GemmInstance<cutlass::bfloat16_t, true, kGemmBlockNNarrow, 2>)
