// One launch of the decode path's GEMM (decode_gemm.cuh), without CUTLASS types:
// out[rows, n] = x[rows, k] @ w[k, n], all row-major, w N-major only (the
// forward weight; the transposed weight of a backward pass is not built).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device_sync.cuh"
#include "flux_jax/params.h"
#include "flux_jax/status.h"

namespace flux_jax::cuda {

// Rows the decode GEMM takes (its widest tile, X's rows along the tile's N).
inline constexpr int64_t kDecodeMaxRows = 128;

struct DecodeGemmPlan {
  int64_t rows = 0, n = 0, k = 0;
  const void* x = nullptr;           // the gathered rows (written by the pushes)
  int64_t x_rows_readable = 0;       // rows of x that may be read (DecodeRowsReadable; 0: rows)
  const void* w = nullptr;
  void* d = nullptr;
  const float* alpha_ptr = nullptr;  // device scalar (1.0f; NaN once a wait timed out)
  PushGate gate;                     // flags to wait for before the first row load
  bool early_launch = false;         // programmatic dependent launch after the push kernel
};

// Rows of x the GEMM may read for `rows` rows: the row tile (64 or 128) rounded up, so no TMA
// box runs past the tensor (a slow path). Rows past `rows` may hold anything.
inline int64_t DecodeRowsReadable(int64_t rows) { return rows <= 64 ? 64 : kDecodeMaxRows; }

// Whether the decode GEMM exists for this input.
inline bool HasDecodeGemm(DType dtype, bool w_transposed, int64_t rows) {
  return dtype == DType::kBF16 && !w_transposed && rows >= 1 && rows <= kDecodeMaxRows;
}

// Launches on `stream`; `sm_count` sizes the persistent grid.
Status RunDecodeGemm(const DecodeGemmPlan& plan, DType dtype, cudaStream_t stream, int device, int sm_count);

// Loads the decode GEMM kernels into the current device's context.
Status PreloadDecodeGemmKernels();

}  // namespace flux_jax::cuda
