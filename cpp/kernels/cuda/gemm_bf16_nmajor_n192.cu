// GEMM instance: cutlass::bfloat16_t, B nmajor, 128x192 tiles (see gemm_instance.cuh): the
// narrow instance for shapes where 128x256 tiles leave most of a last wave idle
// (op_common.h, ChooseBlockN). bf16 only, to keep the build lean.
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_nmajor_n192, GemmInstance<cutlass::bfloat16_t, false, kGemmBlockNNarrow>)
