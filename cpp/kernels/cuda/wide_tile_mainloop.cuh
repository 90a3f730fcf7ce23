// The CUTLASS sm90 mainloop of a cooperative tile wider than one MMA instruction: 128 x 320
// output tiles, each consumer warpgroup owning 64 rows and issuing two m64n160 MMAs per k-step
// (CuTe's extended MMA shapes: define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED before the first
// CUTLASS include). CUTLASS's collective builder takes one MMA atom as wide as the tile (at most
// 256 columns), so this assembles the same collective from CUTLASS's own parts with a TiledMma
// that repeats its atom along N:
//
//            cols 0 ............ 159 | 160 ........... 319
//   rows   0 +------------------------+------------------------+
//            | warpgroup 1, MMA 0     | warpgroup 1, MMA 1     |
//         63 +------------------------+------------------------+
//            | warpgroup 2, MMA 0     | warpgroup 2, MMA 1     |
//        127 +------------------------+------------------------+
//
// Why 320: at N = 5120 (and 2560) the tile count of 128 x 320 tiles fills whole waves where
// 128 x 256 leaves most of a third one idle (2048 x 5120: 256 tiles = 1.9 waves of 132 SMs
// against 320 = 2.4), with fewer B and A reads per output than 128 x 128 ping-pong tiles; it is
// the tile cuBLAS's "320x128 coopB" kernels run on these shapes (in its transposed view).
//
// An N-major B (the [K, N] weight) is stored in 64-byte swizzled rows: each MMA's 160 columns
// then start on a swizzle atom (32 columns; the 128-byte atom is 64, and 160 is 2.5 of it).
#pragma once

#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace flux_jax::cuda {

template <class ElementA, class ElementB, bool kBKMajor, class TileShape, class ClusterShape, int kAtomN,
          class KernelSchedule, int kEpilogueSmemBytes>
struct WideTileMainloop {
  static constexpr int kTileM = decltype(cute::size<0>(TileShape{}))::value;
  static constexpr int kTileN = decltype(cute::size<1>(TileShape{}))::value;
  static constexpr int kTileK = decltype(cute::size<2>(TileShape{}))::value;
  static constexpr cute::GMMA::Major kMajorA = cute::GMMA::Major::K;
  static constexpr cute::GMMA::Major kMajorB = kBKMajor ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
  static_assert(kTileN % kAtomN == 0, "WideTileMainloop: the tile is whole MMA atoms along N");

  // One warpgroup's MMA atom (64 x kAtomN), two warpgroups along M.
  using Atom =
      decltype(cute::GMMA::ss_op_selector<ElementA, ElementB, float,
                                          cute::Shape<cute::Int<kTileM / 2>, cute::Int<kAtomN>, cute::Int<kTileK>>,
                                          kMajorA, kMajorB>());
  using TiledMma = decltype(cute::make_tiled_mma(Atom{}, cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));

  using SmemLayoutAtomA =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<kMajorA, ElementA, cute::Int<kTileM>,
                                                                   cute::Int<kTileK>>());
  using SmemLayoutAtomB = std::conditional_t<kBKMajor,
                                             decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                                                      kMajorB, ElementB, cute::Int<kTileN>, cute::Int<kTileK>>()),
                                             cute::GMMA::Layout_MN_SW64_Atom<ElementB>>;

  static constexpr int kStages = cutlass::gemm::collective::detail::compute_stage_count_or_override<
      cutlass::gemm::collective::detail::sm90_smem_capacity_bytes, ElementA, ElementB, TileShape>(
      cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmemBytes>{});

  using CollectiveOp = cutlass::gemm::collective::CollectiveMma<
      cutlass::gemm::MainloopSm90TmaGmmaWarpSpecialized<kStages, ClusterShape, KernelSchedule>, TileShape, ElementA,
      cutlass::gemm::TagToStrideA_t<cutlass::layout::RowMajor>, ElementB,
      cutlass::gemm::TagToStrideB_t<
          std::conditional_t<kBKMajor, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>>,
      TiledMma,
      decltype(cutlass::gemm::collective::detail::sm90_cluster_shape_to_tma_atom(cute::size<1>(ClusterShape{}))),
      SmemLayoutAtomA, void, cute::identity,
      decltype(cutlass::gemm::collective::detail::sm90_cluster_shape_to_tma_atom(cute::size<0>(ClusterShape{}))),
      SmemLayoutAtomB, void, cute::identity>;
};

}  // namespace flux_jax::cuda
