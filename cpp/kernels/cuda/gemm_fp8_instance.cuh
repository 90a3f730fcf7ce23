// The FP8 GEMMs of the fused ops: A (the rows) float8_e4m3fn, or float8_e5m2 for a backward's dy,
// times B (the weight) float8_e4m3fn, both K-major (as FP8 wgmma reads them), float32
// accumulation, and the scales in a visitor epilogue:
//
//   D[m, n] = alpha * (row_scale[m] * (col_scale[n] * acc[m, n])) + beta * C[m, n]   (bfloat16 D, C)
//
// alpha is the poison scalar every fused GEMM reads per tile (1.0f, NaN once a wait gave up);
// row_scale is x's per-row scale (ag_matmul: every gathered row's, gathered before the call),
// col_scale w's per-column (or broadcast per-tensor) scale. Otherwise the same kernel as
// gemm_instance.cuh: persistent, warp-specialized, the gated mainloop, gated epilogue and rotated
// scheduler of gated_gemm.cuh; cooperative 128x256x128 tiles (128 bytes of K per row) in 1x1
// clusters, or ping-pong 128x128, 128x192 (e4m3 rows) and 128x160 (e5m2 rows) in 2x1 clusters
// sharing B; CUTLASS's FP8 fast accumulation (the
// wgmma accumulator is not promoted every few k-blocks: 2x cuBLASLt's accumulation error from
// K = 7168 to 28672 on one H200, docs/decisions/2026-12-02-fp8-decode-accumulation.md).
#pragma once

#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "fp8_scale_epilogue.cuh"
#include "gemm_instance.cuh"

namespace flux_jax::cuda {

template <class ElementA, class ElementD, int kBlockN = kGemmBlockN, int kClusterM = 1, bool kPingpong = false>
struct GemmInstanceFp8 {
  using Element = cutlass::float_e4m3_t;  // B (the weight) in every instance
  using TileShape = cute::Shape<cute::_128, cute::Int<kBlockN>, cute::_128>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;
  static constexpr int kAlignmentCD = 8;  // N a multiple of 8

  using Scale = Fp8ScaleTree<TileShape, 4>;
  template <class... Ts>
  using EVT = cutlass::epilogue::fusion::Sm90EVT<Ts...>;
  using Beta = cutlass::epilogue::fusion::Sm90ScalarBroadcast<float>;
  using Scaled = EVT<typename Scale::Multiply, typename Scale::Alpha, typename Scale::Vectors>;
  using Fusion = EVT<cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float,
                                                            cutlass::FloatRoundStyle::round_to_nearest>,
                     Beta, cutlass::epilogue::fusion::Sm90SrcFetch<ElementD>, Scaled>;

  using BaseEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementD, cutlass::layout::RowMajor, kAlignmentCD,
      ElementD, cutlass::layout::RowMajor, kAlignmentCD, typename GemmSchedule<kPingpong>::Epilogue,
      Fusion>::CollectiveOp;

  using BaseMainloop = typename OverlapMainloop<ElementA, Element, true, TileShape, ClusterShape,
                                                typename GemmSchedule<kPingpong>::MainloopFp8FastAccum,
                                                static_cast<int>(sizeof(typename BaseEpilogue::SharedStorage))>::type;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, GatedMainloop<BaseMainloop>,
                                                      GatedEpilogue<BaseEpilogue>, RotatedSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // For RunGemmInstance (gemm_instance.cuh): the name in errors, what CUTLASS requires, the
  // launch's arguments.
  static constexpr const char* kWhat = "FP8 GEMM";
  static constexpr const char* kRequirement = "K must be a multiple of 16 and N of 8";
  static typename Kernel::Arguments Arguments(const GemmPlan& p, int device, int sm_count) {
    auto args = GemmArguments<Kernel>(p, device, sm_count);
    // The visitor tree's arguments, children first (Sm90EVT<Node, Children...>: op_0.. the
    // children, the node last): {beta, C, scaled, multiply_add}; in the kernel's orientation
    // x's row scales run along M, w's column scales along N.
    auto& fusion = args.epilogue.thread;
    fusion.op_0.scalars[0] = p.beta;
    Scale::Set(fusion.op_2, p.alpha_ptr, p.row_scale, p.col_scale);
    return args;
  }
};

}  // namespace flux_jax::cuda
