// The overlap GEMM instances of cutlass::half_t, B K-major
// (the transposed weight: dx = dy w^T in a backward pass):
//   128x256          cooperative, 1x1 clusters: the default
//   128x192          cooperative, 1x1 clusters: where 128x256 tiles leave much of a last wave idle
//   128x224          cooperative, 1x1 clusters: dx where its waves fit (N = 6912, 7168)
//   128x160, 2x1     cooperative (m64n160 atoms): dx at 1024 < M <= 2048 where N % 160 == 0
//   128x128 pp, 2x1  ping-pong (one warpgroup's epilogue under the other's MMAs)
//   128x320, 2x1     cooperative, two m64n160 MMAs per warpgroup (wide_tile_mainloop.cuh)
// 2x1: clusters of 2 CTAs along M sharing B by TMA multicast.
// The instances share most of their template instantiation, so one file per element type and weight
// layout compiles far faster than one file per instance (four instances: 87 s in one file, 251 s in
// four, 2 cores). op_common.h, ChooseGemmInstance, picks among them; gemm_instance.cuh builds them.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED  // m64n160 atoms; other tiles keep their standard atoms
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_f16_kmajor, GemmInstance<cutlass::half_t, true, kGemmBlockN>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_f16_kmajor_n192, GemmInstance<cutlass::half_t, true, kGemmBlockNNarrow>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_f16_kmajor_n224, GemmInstance<cutlass::half_t, true, kGemmBlockN224>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_f16_kmajor_n160_c2x1, GemmInstance<cutlass::half_t, true, kGemmBlockN160, 2>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_f16_kmajor_pp128_c2x1,
                              GemmInstance<cutlass::half_t, true, kGemmBlockN128, 2, true>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_f16_kmajor_w320_c2x1, GemmInstance<cutlass::half_t, true, kGemmBlockN320, 2>)
