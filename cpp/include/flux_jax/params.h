// Plain parameter structs shared by the FFI adapters and the backends.
//
// No XLA, nanobind or CUDA types here: the kernels include this header only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace flux_jax {

// kU8: a 1-byte payload (float8_e4m3fn, float8_e5m2, uint8, int8) that is moved,
// never converted or summed: only the all_gather takes it (FP8 operands).
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kU8 = 3 };

inline size_t DTypeBytes(DType t) { return t == DType::kF32 ? 4 : t == DType::kU8 ? 1 : 2; }
inline const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kU8: return "1-byte";
  }
  return "?";
}

// The tensor-parallel group this device belongs to, resolved from the device
// table that the Python lowering passes down (see tp_group.h).
struct TpGroup {
  int rank = 0;                    // position of this device in the group (== lax.axis_index)
  int size = 1;                    // TP degree
  int64_t group_index = 0;         // which group of the mesh (0 for a 1-D mesh)
  std::vector<int64_t> devices;    // global device id of each rank, in rank order
  std::vector<int64_t> processes;  // process index of each rank
  std::vector<int32_t> ordinals;   // local device ordinal of each rank in this process, or -1
  bool cross_process = false;      // some rank lives in another process
  std::string Describe() const;    // "TP group 1 [devices 4,5,6,7]"
};

// Which kernel a fused GEMM op runs (the latency path is a separate custom call:
// XLA's GEMM next to our collective). Decided in Python (flux_jax/_plan.py).
enum class FusedPath : int32_t { kOverlap = 0, kDecode = 1 };

// Which GEMM a fused call's overlap path runs (GpuTuning.gemm_kernel; flux_jax/_config.py
// GEMM_KERNELS lists the same names in this order). kAuto: the instance by shape
// (cpp/kernels/cuda/op_common.h); the others force one instance (an error where this build lacks
// it for the dtype and weight layout). kDecode: the decode path's GEMM on the rows alone, at
// tp = 1 only (measures it without its pushes).
enum class GemmKernel : int64_t {
  kAuto = 0,
  k128x256 = 1,
  k128x192 = 2,            // bf16, f16
  k128x160Cluster2x1 = 3,  // bf16, f16, the transposed weight
  kDecode = 4,
  k128x128PingpongCluster2x1 = 5,  // bf16, f16, FP8: ping-pong schedule
  k128x320Cluster2x1 = 6,          // bf16, f16: cooperative, two m64n160 MMAs per warpgroup
  k128x160PingpongCluster2x1 = 7,  // FP8, e4m3 and e5m2 rows: ping-pong
  k128x224 = 8,                    // bf16, f16, the transposed weight: cooperative, 1x1 clusters
  k128x192PingpongCluster2x1 = 9,  // bf16, f16 with the [K, N] weight, FP8: ping-pong
};
inline constexpr GemmKernel kLastGemmKernel = GemmKernel::k128x192PingpongCluster2x1;  // the handlers' range check

// GPU tuning of the overlap and decode kernels. Every default is the product
// setting; other values exist for A/B measurements (flux_jax/_config.py, private).
struct GpuTuning {
  int64_t piece_bytes = 0;          // target bytes per flagged piece (0: automatic)
  int64_t tile_group_m = 0;         // M tiles the GEMM sweeps together (0: default)
  int64_t tile_serpentine = -1;     // odd tile groups sweep N backwards: 1 on, 0 off, -1 default (on)
  int64_t rs_stage_launches = 1;    // launches of a pushed ReduceScatter stage
                                    // (1: one; 0: about one wave of tiles each)
  int64_t rs_tile_signal = -1;      // pushed RS pieces released by launch end (0) or by
                                    // tile counters (1: at the next tile, 2: right after);
                                    // -1: by shape (ChooseRsTileSignal)
  int64_t tile_n = 0;               // output tile width, 256 or 192 (0: by waves)
  bool decode_early_launch = true;  // the decode GEMM launches while the rows are pushed
  int64_t gemm_kernel = 0;          // a GemmKernel (0: by shape)
  bool gate_probe = false;          // tp = 1, ag_matmul: gate every tile's A loads on flags
                                    // that are already set (the cost of the gate's poll)
};

// Everything a fused call needs besides its buffers, decoded from the custom
// call's typed attributes (cpp/ffi/attrs.h).
struct CommConfig {
  int64_t timeout_us = 30'000'000;  // bound on every wait
  int64_t jitter_us = 0;            // CPU backend: random delay before each signal (tests)
  int64_t drop_rank = -1;           // tests: this rank never signals its chunks (timeouts)
  int64_t callsite = 0;             // id of the custom-call site (pairs calls across devices)
  bool poison_outputs = false;      // tests: fill outputs with NaN first, so unwritten
                                    // elements cannot pass a test
  FusedPath path = FusedPath::kOverlap;
  GpuTuning tuning;
};

// FP8 operands of a fused GEMM op: x and w in float8_e4m3fn (w transposed, [n, k]: FP8 GEMMs
// read both operands K-major), the output in `dtype`,
//   out[i, j] = row_scale[i] * col_scale[j] * sum_k x[i, k] * w[j, k]   (float32 accumulation).
// row_scale covers the GEMM's rows (ag_matmul: all tp*m_local gathered rows, rank order; on its
// decode path only this rank's m_local rows, whose scales travel with them).
struct Fp8Operands {
  bool on = false;
  bool x_e5m2 = false;  // x in float8_e5m2 (a backward's dy rows), else float8_e4m3fn; w is e4m3fn
  const float* row_scale = nullptr;
  const float* col_scale = nullptr;  // [n]
};

// out[tp*m_local, n] = all_gather(x[m_local, k]) @ op(w), op(w) = w or w^T.
struct AgMatmulParams {
  const void* x = nullptr;   // [m_local, k]
  const void* w = nullptr;   // [k, n], or [n, k] when w_transposed
  void* out = nullptr;       // [tp*m_local, n]
  void* gathered = nullptr;  // optional [tp*m_local, k], x's element type
  int64_t m_local = 0, k = 0, n = 0;
  DType dtype = DType::kBF16;  // out (and x, w unless fp8)
  bool w_transposed = false;
  Fp8Operands fp8;
};

// out[m/tp, n] = reduce_scatter(x[m, k_local] @ op(w)) over the leading axis.
struct MatmulRsParams {
  const void* x = nullptr;  // [m, k]
  const void* w = nullptr;  // [k, n], or [n, k] when w_transposed
  void* out = nullptr;      // [m/tp, n]
  int64_t m = 0, k = 0, n = 0;
  DType dtype = DType::kBF16;  // out (and x, w unless fp8)
  bool w_transposed = false;
  Fp8Operands fp8;
};

// Bytes per element of x and w.
inline size_t OperandBytes(DType dtype, const Fp8Operands& fp8) { return fp8.on ? 1 : DTypeBytes(dtype); }

}  // namespace flux_jax
