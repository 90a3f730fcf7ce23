// GEMM instance: cutlass::bfloat16_t, B kmajor, 128x192 tiles (see gemm_instance.cuh): the narrow
// instance of the transposed weight, for dx shapes where 128x256 tiles leave much of a last wave
// idle (op_common.h, ChooseBlockN).
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_kmajor_n192, GemmInstance<cutlass::bfloat16_t, true, kGemmBlockNNarrow>)
