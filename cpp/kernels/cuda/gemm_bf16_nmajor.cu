// The overlap GEMM instances of cutlass::bfloat16_t, B N-major (the [K, N] weight):
//   128x256          cooperative, 1x1 clusters: the default
//   128x192          cooperative, 1x1 clusters: where 128x256 tiles leave much of a last wave idle
//   128x128 pp, 2x1  ping-pong (one warpgroup's epilogue under the other's MMAs)
//   128x320, 2x1     cooperative, two m64n160 MMAs per warpgroup (wide_tile_mainloop.cuh)
//   128x192 pp, 2x1  ping-pong: where the GPU's DRAM is below 4 TB/s (an H100) and M > 2048
// 2x1: clusters of 2 CTAs along M sharing B by TMA multicast.
// The instances share most of their template instantiation, so one file per element type and weight
// layout compiles far faster than one file per instance (four instances: 87 s in one file, 251 s in
// four, 2 cores). op_common.h, ChooseGemmInstance, picks among them; gemm_instance.cuh builds them.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED  // m64n160 atoms; other tiles keep their standard atoms
#include "gemm_instance.cuh"

FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_nmajor, GemmInstance<cutlass::bfloat16_t, false, kGemmBlockN>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_nmajor_n192, GemmInstance<cutlass::bfloat16_t, false, kGemmBlockNNarrow>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_nmajor_pp128_c2x1,
                              GemmInstance<cutlass::bfloat16_t, false, kGemmBlockN128, 2, true>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_nmajor_w320_c2x1,
                              GemmInstance<cutlass::bfloat16_t, false, kGemmBlockN320, 2>)
FLUX_JAX_DEFINE_GEMM_INSTANCE(RunGemm_bf16_nmajor_pp192_c2x1,
                              GemmInstance<cutlass::bfloat16_t, false, kGemmBlockNNarrow, 2, true>)
