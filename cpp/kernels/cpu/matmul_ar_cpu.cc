// GEMM -> AllReduce on the CPU backend.
//
// Schedule of rank r (TP = 4, r = 1): the partial product is computed once,
// in float32, and pushed whole into every peer's slot; then every rank sums
// the tp partials in the fixed order rank 0, 1, 2, 3 and rounds once, so
// every rank holds the same bits:
//
//   P[1] = x @ w                               (float32, all m rows)
//   push P[1] -> rank 2, 3, 0                  (each after that peer freed the slot)
//   out  = slot[0] + P[1] + slot[2] + slot[3]  (each slot after arrived >= epoch)
//
// See channel.h for the flag protocol.
#include <cstring>
#include <vector>

#include "channel.h"
#include "flux_jax/matmul_ar.h"
#include "host_gemm.h"

namespace flux_jax {

Status RunMatmulArCpu(const MatmulArParams& p, const TpGroup& group, const CommConfig& cfg) {
  FLUX_JAX_RETURN_IF_ERROR(MatmulArCanImplement(p, group));
  const int tp = group.size, rank = group.rank;
  const int64_t elems = p.m * p.n;
  const size_t partial_bytes = static_cast<size_t>(elems) * sizeof(float);

  const uint64_t signature =
      cpu::HashInts({6, p.m, p.k, p.n, static_cast<int64_t>(p.dtype), p.w_transposed, p.fp8.on, p.fp8.x_e5m2});
  cpu::ChannelCall call;
  FLUX_JAX_RETURN_IF_ERROR(call.Open(group, cfg, partial_bytes, signature));
  cpu::Channel& channel = call.channel();
  const uint64_t epoch = call.epoch();
  const int parity = call.parity();
  if (cfg.poison_outputs) std::memset(p.out, 0xFF, static_cast<size_t>(elems) * DTypeBytes(p.dtype));

  // 1. This rank's partial, pushed whole to every peer.
  const std::vector<float> w = p.fp8.on ? cpu::Fp8WeightAsFloat(p.w, p.k, p.n, p.fp8.col_scale)
                                        : cpu::WeightAsFloat(p.w, p.dtype, p.k, p.n, p.w_transposed);
  std::vector<float> own(static_cast<size_t>(elems));
  if (p.fp8.on) {
    cpu::GemmRowsFp8(p.x, p.fp8.x_e5m2, p.m, p.k, w.data(), p.n, p.fp8.row_scale, own.data());
  } else {
    cpu::GemmRows(p.x, p.dtype, p.m, p.k, w.data(), p.n, own.data());
  }
  for (int i = 1; i < tp; ++i) {
    const int dst = (rank + i) % tp;
    FLUX_JAX_RETURN_IF_ERROR(channel.Wait(rank, cpu::FlagKind::kFreed, parity, dst, epoch >= 2 ? epoch - 2 : 0, epoch,
                                          cfg, {"matmul_ar", dst, rank}));
    if (partial_bytes) std::memcpy(channel.Slot(dst, parity, rank), own.data(), partial_bytes);
    if (rank != cfg.drop_rank) channel.Signal(dst, cpu::FlagKind::kArrived, parity, rank, epoch, cfg);
  }

  // 2. The sum of the tp partials in rank order, rounded once.
  std::vector<float> acc(static_cast<size_t>(elems), 0.0f);
  for (int src = 0; src < tp; ++src) {
    const float* part = own.data();
    if (src != rank) {
      FLUX_JAX_RETURN_IF_ERROR(
          channel.Wait(rank, cpu::FlagKind::kArrived, parity, src, epoch, epoch, cfg, {"matmul_ar", src, src}));
      part = reinterpret_cast<const float*>(channel.Slot(rank, parity, src));
    }
    for (int64_t i = 0; i < elems; ++i) acc[i] += part[i];
    if (src != rank) channel.Signal(src, cpu::FlagKind::kFreed, parity, rank, epoch, cfg);
  }
  cpu::FromFloat(acc.data(), elems, p.dtype, p.out);
  return call.Finish(cfg, "matmul_ar");
}

}  // namespace flux_jax
