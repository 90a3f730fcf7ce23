// The FP8 overlap GEMM instances: float8 operands, B K-major, bfloat16 out with row and column
// scales in the epilogue (gemm_fp8_instance.cuh; op_common.h, ChooseFp8GemmInstance):
//   e4m3 x e4m3, 128x256          cooperative, 1x1 clusters: K > 4096 at 8192 x 8192 outputs and
//                                 more, or below them at K >= 8192 where its waves tie; on a GPU
//                                 below 4 TB/s of DRAM (an H100) at any K from 8192 x 8192 outputs
//   e4m3 x e4m3, 128x128 pp, 2x1  ping-pong, B shared by TMA multicast: the rest
//   e4m3 x e4m3, 128x192 pp, 2x1  below 4 TB/s of DRAM, M > 2048 and K <= 4096, where its waves are
//                                 at most 5% longer than 128x256's (either of the two above); at
//                                 M <= 2048, any K, where they are no longer than 128x128's
//   e4m3 x e4m3, 128x160 pp, 2x1  below 4 TB/s of DRAM, in place of either ping-pong tile above where
//                                 N % 160 == 0 and its waves give each SM no more columns
//   e5m2 x e4m3, 128x128 pp, 2x1  the backward's dy rows (e5m2) times the weight
//   e5m2 x e4m3, 128x160 pp, 2x1  the same where 160-column tiles make fewer waves
//   e5m2 x e4m3, 128x192 pp, 2x1  the same on GPUs below PingpongAtManyWaves' DRAM line (an
//                                 H100) at K <= 4608, where its waves are at most 5% longer; at
//                                 M <= 2048 as for e4m3 rows; either gives way to 128x160 as for e4m3
// One file: the instances share most of their template instantiation (see gemm_bf16_kmajor.cu).
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED  // m64n160 atoms; other tiles keep their standard atoms
#include "gemm_fp8_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_e4m3_bf16, GemmInstanceFp8<cutlass::float_e4m3_t, cutlass::bfloat16_t>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_e4m3_bf16_pp128_c2x1,
                              GemmInstanceFp8<cutlass::float_e4m3_t, cutlass::bfloat16_t, kGemmBlockN128, 2, true>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_e4m3_bf16_pp160_c2x1,
                              GemmInstanceFp8<cutlass::float_e4m3_t, cutlass::bfloat16_t, kGemmBlockN160, 2, true>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_e4m3_bf16_pp192_c2x1,
                              GemmInstanceFp8<cutlass::float_e4m3_t, cutlass::bfloat16_t, kGemmBlockNNarrow, 2, true>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_e5m2_bf16_pp128_c2x1,
                              GemmInstanceFp8<cutlass::float_e5m2_t, cutlass::bfloat16_t, kGemmBlockN128, 2, true>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_e5m2_bf16_pp160_c2x1,
                              GemmInstanceFp8<cutlass::float_e5m2_t, cutlass::bfloat16_t, kGemmBlockN160, 2, true>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_e5m2_bf16_pp192_c2x1,
                              GemmInstanceFp8<cutlass::float_e5m2_t, cutlass::bfloat16_t, kGemmBlockNNarrow, 2, true>)
