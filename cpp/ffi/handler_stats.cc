#include "handler_stats.h"

#include <atomic>

namespace flux_jax::ffi_adapter {
namespace {

struct AtomicStat {
  std::atomic<uint64_t> calls{0}, total_ns{0}, max_ns{0};
};

AtomicStat g_stats[static_cast<int>(HandlerOp::kCount)];

AtomicStat& StatOf(HandlerOp op) { return g_stats[static_cast<int>(op)]; }

}  // namespace

const char* HandlerOpName(HandlerOp op) {
  static constexpr const char* kNames[] = {
#define FLUX_JAX_OP(snake, Pascal) #snake,
#include "flux_jax/ops.def"
#undef FLUX_JAX_OP
  };
  const int i = static_cast<int>(op);
  return i >= 0 && i < static_cast<int>(HandlerOp::kCount) ? kNames[i] : "?";
}

void RecordHandlerTime(HandlerOp op, uint64_t ns) {
  AtomicStat& s = StatOf(op);
  s.calls.fetch_add(1, std::memory_order_relaxed);
  s.total_ns.fetch_add(ns, std::memory_order_relaxed);
  uint64_t seen = s.max_ns.load(std::memory_order_relaxed);
  while (ns > seen && !s.max_ns.compare_exchange_weak(seen, ns, std::memory_order_relaxed)) {
  }
}

HandlerStat GetHandlerStat(HandlerOp op) {
  const AtomicStat& s = StatOf(op);
  return {s.calls.load(std::memory_order_relaxed), s.total_ns.load(std::memory_order_relaxed),
          s.max_ns.load(std::memory_order_relaxed)};
}

void ResetHandlerStats() {
  for (AtomicStat& s : g_stats) {
    s.calls.store(0, std::memory_order_relaxed);
    s.total_ns.store(0, std::memory_order_relaxed);
    s.max_ns.store(0, std::memory_order_relaxed);
  }
}

}  // namespace flux_jax::ffi_adapter
