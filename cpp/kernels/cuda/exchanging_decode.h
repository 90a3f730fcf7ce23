// The decode paths whose GEMM epilogue exchanges its output (decode_exchange.cuh):
// matmul_rs's (reduce-scatter, matmul_rs_decode.cu) and matmul_ar's (all-reduce,
// matmul_ar_decode.cu). One call's setup, shared by both.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flux_jax/params.h"
#include "flux_jax/status.h"
#include "flux_jax/tp_group.h"

namespace flux_jax::cuda {

struct ExchangingDecodeCall {
  const void* x = nullptr;  // [m, k], this rank's input
  const void* w = nullptr;  // [k, n], or [n, k] with FP8 operands
  void* out = nullptr;      // [reduced_rows, n]
  int64_t m = 0, k = 0, n = 0;
  DType dtype = DType::kBF16;  // out (and x, w unless fp8)
  Fp8Operands fp8;             // row_scale: [m], this rank's rows'; col_scale: [n]
  int64_t reduced_rows = 0;    // rows each rank sums: m / tp (reduce-scatter) or m (all-reduce)
  bool all_reduce = false;
};

// Poisons out if asked, stages x into whole row tiles where m is not (a TMA box past its tensor's
// end takes a slow path), takes this call's epoch and parity halves of the workspace (P and the
// staged rows in the slot area, read by no peer; tp blocks of reduced_rows rows of low-latency
// words) and launches the decode GEMM with its exchange on `stream`. The caller checked the call.
Status RunExchangingDecode(const ExchangingDecodeCall& c, const TpGroup& group, const CommConfig& cfg,
                           cudaStream_t stream);

}  // namespace flux_jax::cuda
