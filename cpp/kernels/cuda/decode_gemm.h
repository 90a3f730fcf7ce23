// One launch of the decode path's GEMM (decode_gemm.cuh), without CUTLASS types:
// out[rows, n] = x[rows, k] @ w[k, n], all row-major, w N-major only (the
// forward weight; the transposed weight of a backward pass is not built); or, with
// FP8 operands, out = row_scale[rows] * col_scale[n] * (x[rows, k] @ w[n, k]^T), x and w
// float8_e4m3fn (w transposed: FP8 GEMMs read both operands K-major), out bfloat16.
// With a DecodeExchange its epilogue also reduce-scatters or all-reduces the result
// across the TP group, tile by tile (matmul_rs_decode.cu, matmul_ar_decode.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device_sync.cuh"
#include "flux_jax/limits.h"
#include "flux_jax/params.h"
#include "flux_jax/status.h"

namespace flux_jax::cuda {

// Rows the decode GEMM takes: one 64-row tile, up to two 128-row tiles, or one 256-row tile (X's
// rows along the tile's N). ag_matmul's decode path takes them all.
inline constexpr int64_t kDecodeMaxRows = limits::kDecodeAgMaxRows;
// Rows matmul_rs's exchanging epilogue takes: one tile holds all rows of its 64 columns.
inline constexpr int64_t kDecodeExchangeMaxRows = limits::kDecodeRsMaxRows;

// Ranks the exchanging epilogue serves (its peer tables are indexed with
// compile-time indices only, so the kernel parameters stay in constant space).
inline constexpr int kDecodeMaxRanks = limits::kDecodeMaxTp;

// matmul_rs's and matmul_ar's decode paths: the GEMM's D is this rank's partial
// P[rows, n]; once a tile of P is written, its epilogue stores the rows of P that
// rank q sums (reduce-scatter: rows q*reduced_rows ..; all-reduce: all rows) into
// q's low-latency receive area, each 4 bytes of data next to the call's epoch,
// waits for every peer's words of the tile and writes the rows it sums of
// out = sum over ranks q = 0..tp-1, in that order, in float32, rounded once
// (decode_exchange.cuh).
struct DecodeExchange {
  int32_t tp = 0;  // 0: no exchange (the plain GEMM: ag_matmul's decode path)
  int32_t rank = 0;
  int32_t reduced_rows = 0;  // rows each rank sums: m / tp (reduce-scatter) or m (all-reduce)
  int32_t n = 0;
  bool all_reduce = false;                // every rank sums all rows (else rank q its own block)
  const void* partial = nullptr;          // P = D, [rows, n] (this rank's workspace)
  void* out = nullptr;                    // [reduced_rows, n]
  const void* recv = nullptr;             // my low-latency slots: [sender][reduced_rows][n / 8][2] x 16 B
  void* peer_recv[kDecodeMaxRanks] = {};  // rank q's low-latency slots of sender `rank`
  bool signal_peers = true;               // false: debug_drop_rank (tests the timeout)
  WaitContext ctx;

  // The first row of P that rank q sums.
  __host__ __device__ int64_t FirstRowOf(int q) const {
    return all_reduce ? 0 : static_cast<int64_t>(q) * reduced_rows;
  }
};

// Bytes of low-latency receive slots for `rows` rows of n columns (one parity: all the call's
// rows, one block per sender): every 16-byte vector of data travels as two 16-byte words (data,
// epoch, data, epoch).
inline size_t DecodeExchangeBytes(int64_t rows, int64_t n) { return static_cast<size_t>(rows * n) * 2 * 2; }

struct DecodeGemmPlan {
  int64_t rows = 0, n = 0, k = 0;
  const void* x = nullptr;      // the gathered rows (written by the pushes)
  int64_t x_rows_readable = 0;  // rows of x that may be read (DecodeRowsReadable; 0: rows)
  const void* w = nullptr;
  void* d = nullptr;
  const float* alpha_ptr = nullptr;  // device scalar (1.0f; NaN once a wait timed out)
  bool fp8 = false;                  // x, w float8_e4m3fn (w [n, k]), d bfloat16, the scales below
  const float* row_scale = nullptr;  // [rows], FP8 only
  const float* col_scale = nullptr;  // [n], FP8 only
  PushGate gate;                     // flags to wait for before the first row load
  bool early_launch = false;         // programmatic dependent launch after the push kernel
  DecodeExchange exchange;           // tp == 0: none
};

// Whether 129..256 rows run as one 256-row tile per 64 weight columns instead of two 128-row
// tiles: where the 128-row tiles would take more than one wave of SMs. One 256-row tile reads
// the weight once (two 128-row tiles read it twice) but leaves SMs idle where the 128-row tiles
// fit one wave (one H200, kernel time: 192 x 4096 x 5120 29.4 -> 24.0 us, 192 x 4096 x 4096
// 14.8 -> 23.0). bfloat16 without an exchange (matmul_rs and matmul_ar take <= 128 rows).
inline bool UseDecodeRowTile256(int64_t rows, int64_t n, bool exchange, int sm_count) {
  const int64_t column_tiles = (n + 63) / 64;
  return rows > 128 && !exchange && 2 * column_tiles > sm_count;
}

// Rows of x the GEMM may read for `rows` rows: rounded up to whole row tiles (64 rows, else a
// multiple of 128, which 129..256 rows round to 256: one whole 256-row tile too), so no TMA box
// runs past the tensor (a slow path). Rows past `rows` may hold anything.
inline int64_t DecodeRowsReadable(int64_t rows) { return rows <= 64 ? 64 : (rows + 127) / 128 * 128; }

// Whether the decode GEMM exists for this input: bfloat16 with the untransposed weight, or FP8
// operands (float8_e4m3fn rows, the transposed weight) with a bfloat16 output.
inline bool HasDecodeGemm(DType dtype, bool w_transposed, int64_t rows, const Fp8Operands& fp8 = {}) {
  const bool operands = fp8.on ? !fp8.x_e5m2 && w_transposed : !w_transposed;
  return dtype == DType::kBF16 && operands && rows >= 1 && rows <= kDecodeMaxRows;
}

// Launches on `stream`; `sm_count` sizes the persistent grid. `dtype` is D's (and x's and w's
// unless plan.fp8).
Status RunDecodeGemm(const DecodeGemmPlan& plan, DType dtype, cudaStream_t stream, int device, int sm_count);

// The FP8 instances (gemm_decode_e4m3.cu), called by RunDecodeGemm.
Status RunDecodeGemmFp8(const DecodeGemmPlan& plan, cudaStream_t stream, int device, int sm_count);
Status PreloadDecodeGemmFp8Kernels();

// Loads the decode GEMM kernels into the current device's context.
Status PreloadDecodeGemmKernels();

}  // namespace flux_jax::cuda
