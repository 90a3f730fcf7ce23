// Host API of the fused GEMM -> AllReduce op (one entry point per backend):
// tensor parallelism without sequence parallelism, every rank keeps the whole
// output.
#pragma once

#include "flux_jax/params.h"
#include "flux_jax/status.h"

namespace flux_jax {

// out[m, n] = sum over ranks (in rank order 0..tp-1) of x[m, k_local] @ op(w),
// op(w) = w or w^T; bitwise the same on every rank.
struct MatmulArParams {
  const void* x = nullptr;  // [m, k]
  const void* w = nullptr;  // [k, n], or [n, k] when w_transposed
  void* out = nullptr;      // [m, n]
  int64_t m = 0, k = 0, n = 0;
  DType dtype = DType::kBF16;  // out (and x, w unless fp8)
  bool w_transposed = false;
  Fp8Operands fp8;  // row_scale: [m], this rank's rows'
};

Status MatmulArCanImplement(const MatmulArParams& p, const TpGroup& group);

// CPU backend: partials in float32, summed in rank order 0..tp-1, rounded once.
Status RunMatmulArCpu(const MatmulArParams& p, const TpGroup& group, const CommConfig& cfg);

// CUDA backend (only when built with CUDA): enqueues on `stream` our GEMM of the
// partial into the workspace, then the latency path's all_reduce kernel on it; on
// the decode path (FusedPath::kDecode) one decode GEMM whose epilogue all-reduces.
Status RunMatmulArCuda(const MatmulArParams& p, const TpGroup& group, const CommConfig& cfg, void* stream);

}  // namespace flux_jax
