// Limits of the kernels that the Python planner must respect. This header is
// the only definition: the CUDA code includes it, and the extension exports
// every value below to Python (`_flux_jax_ffi.limits()`, read by flux_jax/_plan.py).
#pragma once

#include <cstdint>

namespace flux_jax::limits {

// TP degree of one group: the CPU backend's mailboxes, the GPU workspace's flag
// tables, the latency collectives' and decode kernels' peer tables (indexed
// with compile-time indices so kernel parameters stay in constant space).
inline constexpr int kCpuMaxTp = 64;
inline constexpr int kGpuMaxTp = 16;
inline constexpr int kLatencyMaxTp = 8;
inline constexpr int kDecodeMaxTp = 8;

// Rows the decode GEMM takes: one 64-row tile, or up to two of its 128-row
// tiles. ag_matmul's decode path takes them all (rows of every rank).
inline constexpr int64_t kDecodeAgMaxRows = 256;
// Rows matmul_rs's decode path takes: its exchanging epilogue holds all rows
// of its 64 columns in one tile.
inline constexpr int64_t kDecodeRsMaxRows = 128;
// Output columns of matmul_rs's decode path: its low-latency receive area
// (two parities of rows x n x 4 bytes) must fit the fixed area of a TP group
// that spans processes (64 MiB).
inline constexpr int64_t kDecodeRsMaxN = 32768;
// matmul_ar's decode path: rows as matmul_rs's (one tile holds all rows of its
// 64 columns); every rank receives every peer's whole partial, so its receive
// area is two parities of tp x rows x n x 4 bytes, bounded as matmul_rs's.
inline constexpr int64_t kDecodeArMaxRows = 128;
inline constexpr int64_t kDecodeArMaxElements = int64_t{1} << 22;  // tp x rows x n

// The GPU kernels move rows as 16-byte vectors of 2-byte elements.
inline constexpr int64_t kGpuAlignElements = 8;

}  // namespace flux_jax::limits
