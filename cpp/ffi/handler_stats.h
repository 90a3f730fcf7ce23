// Host time spent inside each FFI handler, per op, from entry to return: what one call costs the
// thread that enqueues it (on GPU: decoding, planning and the launches, not the kernels; on CPU
// the whole computation). Always on: two clock reads and three relaxed atomics per call.
//
// Why: XLA runs a device's thunks on one host thread; when that thread spends longer per call
// than the GPU does, the GPU idles between calls and device-side speedups do not show in the loop.
#pragma once

#include <chrono>
#include <cstdint>

namespace flux_jax::ffi_adapter {

// One counter per op of flux_jax/ops.def: HandlerOp::kAgMatmul, ...
enum class HandlerOp : int {
#define FLUX_JAX_OP(snake, Pascal) k##Pascal,
#include "flux_jax/ops.def"
#undef FLUX_JAX_OP
  kCount
};

struct HandlerStat {
  uint64_t calls = 0;
  uint64_t total_ns = 0;
  uint64_t max_ns = 0;
};

const char* HandlerOpName(HandlerOp op);
HandlerStat GetHandlerStat(HandlerOp op);
void ResetHandlerStats();
void RecordHandlerTime(HandlerOp op, uint64_t ns);

// Records the time from construction to destruction under `op`.
class ScopedHandlerTimer {
 public:
  explicit ScopedHandlerTimer(HandlerOp op) : op_(op), start_(std::chrono::steady_clock::now()) {}
  ~ScopedHandlerTimer() {
    const auto ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
    RecordHandlerTime(op_, static_cast<uint64_t>(ns));
  }
  ScopedHandlerTimer(const ScopedHandlerTimer&) = delete;
  ScopedHandlerTimer& operator=(const ScopedHandlerTimer&) = delete;

 private:
  HandlerOp op_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace flux_jax::ffi_adapter
