// GEMM -> ReduceScatter on the CPU backend.
//
// Schedule of rank r (TP = 4, r = 1): partials owned by peers first, each
// pushed as soon as it is computed, then the rank's own rows, reduced in the
// fixed order rank 0, 1, 2, 3 so the result is bitwise reproducible:
//
//   P[2] = x[chunk 2] @ w -> push to rank 2
//   P[3] = x[chunk 3] @ w -> push to rank 3
//   P[0] = x[chunk 0] @ w -> push to rank 0
//   P[1] = x[chunk 1] @ w               (own rows)
//   out  = slot[0] + P[1] + slot[2] + slot[3]   (each slot after arrived >= epoch)
//
// Partials travel in float32, so the reduction rounds once, at the end.
#include <cstring>
#include <vector>

#include "channel.h"
#include "flux_jax/matmul_rs.h"
#include "host_gemm.h"

namespace flux_jax {

Status RunMatmulRsCpu(const MatmulRsParams& p, const TpGroup& group, const CommConfig& cfg) {
  FLUX_JAX_RETURN_IF_ERROR(MatmulRsCanImplement(p, group));
  const int tp = group.size, rank = group.rank;
  const size_t elt = DTypeBytes(p.dtype);
  const int64_t m_out = p.m / tp;
  const int64_t chunk_out = m_out * p.n;
  const size_t partial_bytes = static_cast<size_t>(chunk_out) * sizeof(float);

  const uint64_t signature =
      cpu::HashInts({2, p.m, p.k, p.n, static_cast<int64_t>(p.dtype), p.w_transposed, p.fp8.on, p.fp8.x_e5m2});
  cpu::ChannelCall call;
  FLUX_JAX_RETURN_IF_ERROR(call.Open(group, cfg, partial_bytes, signature));
  cpu::Channel& channel = call.channel();
  const uint64_t epoch = call.epoch();
  const int parity = call.parity();
  if (cfg.poison_outputs) std::memset(p.out, 0xFF, static_cast<size_t>(chunk_out) * elt);

  const std::vector<float> w = p.fp8.on ? cpu::Fp8WeightAsFloat(p.w, p.k, p.n, p.fp8.col_scale)
                                        : cpu::WeightAsFloat(p.w, p.dtype, p.k, p.n, p.w_transposed);
  const size_t x_elt = OperandBytes(p.dtype, p.fp8);
  auto x_chunk = [&](int c) { return static_cast<const char*>(p.x) + c * m_out * p.k * x_elt; };
  auto gemm = [&](int c, float* out) {
    if (p.fp8.on) {
      cpu::GemmRowsFp8(x_chunk(c), p.fp8.x_e5m2, m_out, p.k, w.data(), p.n, p.fp8.row_scale + c * m_out, out);
    } else {
      cpu::GemmRows(x_chunk(c), p.dtype, m_out, p.k, w.data(), p.n, out);
    }
  };

  // 1. Partials of the peers' rows: compute straight into the peer's slot.
  for (int i = 1; i < tp; ++i) {
    const int dst = (rank + i) % tp;
    FLUX_JAX_RETURN_IF_ERROR(channel.Wait(rank, cpu::FlagKind::kFreed, parity, dst, epoch >= 2 ? epoch - 2 : 0, epoch,
                                          cfg, {"matmul_rs", dst, dst}));
    auto* slot = reinterpret_cast<float*>(channel.Slot(dst, parity, rank));
    gemm(dst, slot);
    if (rank != cfg.drop_rank) {
      channel.Signal(dst, cpu::FlagKind::kArrived, parity, rank, epoch, cfg);
    }
  }

  // 2. Own partial, then the reduction in rank order.
  std::vector<float> own(static_cast<size_t>(chunk_out));
  gemm(rank, own.data());
  std::vector<float> acc(static_cast<size_t>(chunk_out), 0.0f);
  for (int src = 0; src < tp; ++src) {
    const float* part = own.data();
    if (src != rank) {
      FLUX_JAX_RETURN_IF_ERROR(
          channel.Wait(rank, cpu::FlagKind::kArrived, parity, src, epoch, epoch, cfg, {"matmul_rs", src, rank}));
      part = reinterpret_cast<const float*>(channel.Slot(rank, parity, src));
    }
    for (int64_t i = 0; i < chunk_out; ++i) acc[i] += part[i];
    if (src != rank) channel.Signal(src, cpu::FlagKind::kFreed, parity, rank, epoch, cfg);
  }
  cpu::FromFloat(acc.data(), chunk_out, p.dtype, p.out);
  return call.Finish(cfg, "matmul_rs");
}

}  // namespace flux_jax
