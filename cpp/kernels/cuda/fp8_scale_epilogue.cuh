// The scaling part of the FP8 GEMMs' visitor epilogues (the overlap GEMM of gemm_fp8_instance.cuh
// and the decode GEMM of decode_gemm.cuh): in the kernel's own (M, N) orientation
//
//   scaled[i, j] = alpha * (col_vector[i] * (row_vector[j] * acc[i, j]))
//
// col_vector runs along the tile's M (one value per output row of the kernel), row_vector along
// its N. Which scale is which depends on the orientation: the overlap GEMM (M = x's rows) takes
// x's row scales as col_vector and w's column scales as row_vector; the swap-AB decode GEMM
// (M = w's columns) the other way round. alpha is the poison scalar every fused GEMM reads per
// tile (1.0f, NaN once a wait gave up).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"

namespace flux_jax::cuda {

template <class TileShape, int kRowVectorStages>
struct Fp8ScaleTree {
  template <class... Ts>
  using EVT = cutlass::epilogue::fusion::Sm90EVT<Ts...>;
  using Multiply = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                                          cutlass::FloatRoundStyle::round_to_nearest>;
  using ColVector = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float, float,
                                                                cute::Stride<cute::_1, cute::_0, int64_t>, 1>;
  using RowVector =
      cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float, float, cute::Stride<cute::_0, cute::_1, int64_t>,
                                                  kRowVectorStages>;
  using Alpha = cutlass::epilogue::fusion::Sm90ScalarBroadcast<float, cute::Stride<cute::_0, cute::_0, int64_t>>;
  // col_vector * (row_vector * acc), in float32.
  using Vectors = EVT<Multiply, ColVector, EVT<Multiply, RowVector, cutlass::epilogue::fusion::Sm90AccFetch>>;

  // The arguments of a node `Node<..., Alpha, Vectors>` (children first: op_0 = alpha, op_1 = the
  // vectors' subtree {col_vector, {row_vector, acc, *}, *}). alpha's nonzero batch stride makes
  // every tile read it (a wait that times out poisons it after the kernel started).
  template <class NodeArguments>
  static void Set(NodeArguments& node, const float* alpha_ptr, const float* col_vector, const float* row_vector) {
    node.op_0.scalars[0] = 1.0f;
    node.op_0.scalar_ptrs[0] = alpha_ptr;
    node.op_0.dScalar[0] = {cute::_0{}, cute::_0{}, 1};
    auto& col_scaled = node.op_1;
    col_scaled.op_0.ptr_col = col_vector;
    col_scaled.op_0.dCol = {cute::_1{}, cute::_0{}, 0};
    auto& row_scaled = col_scaled.op_1;
    row_scaled.op_0.ptr_row = row_vector;
    row_scaled.op_0.dRow = {cute::_0{}, cute::_1{}, 0};
  }
};

}  // namespace flux_jax::cuda
