// AllGather -> GEMM on the CPU backend.
//
// Schedule of rank r (TP = 4, r = 1), chunks in the order the GPU kernel's
// tiles visit them (rotated so the local chunk goes first):
//
//   push x_1 -> rank 2, 3, 0        (each after that peer freed the slot)
//   out[chunk 1] = x_1 @ w          local rows: no wait
//   out[chunk 2] = slot[2] @ w      after arrived[2] >= epoch
//   out[chunk 3] = slot[3] @ w      after arrived[3] >= epoch
//   out[chunk 0] = slot[0] @ w      after arrived[0] >= epoch
//
// FP8 on the decode path: each rank holds only its own rows' scales, which travel in the slot
// after the rows (as the GPU push kernel moves them). See channel.h for the flag protocol.
#include <cstring>
#include <vector>

#include "channel.h"
#include "flux_jax/ag_matmul.h"
#include "host_gemm.h"

namespace flux_jax {

Status RunAgMatmulCpu(const AgMatmulParams& p, const TpGroup& group, const CommConfig& cfg) {
  FLUX_JAX_RETURN_IF_ERROR(AgMatmulCanImplement(p, group));
  const int tp = group.size, rank = group.rank;
  const size_t elt = DTypeBytes(p.dtype);  // out
  const size_t chunk_bytes = static_cast<size_t>(p.m_local * p.k) * OperandBytes(p.dtype, p.fp8);
  const int64_t chunk_out = p.m_local * p.n;  // output elements per chunk
  const bool local_scales = p.fp8.on && cfg.path == FusedPath::kDecode;
  const size_t scale_bytes = local_scales ? static_cast<size_t>(p.m_local) * sizeof(float) : 0;

  const uint64_t signature = cpu::HashInts(
      {1, p.m_local, p.k, p.n, static_cast<int64_t>(p.dtype), p.w_transposed, p.fp8.on, p.fp8.x_e5m2, local_scales});
  cpu::ChannelCall call;
  FLUX_JAX_RETURN_IF_ERROR(call.Open(group, cfg, chunk_bytes + scale_bytes, signature));
  cpu::Channel& channel = call.channel();
  const uint64_t epoch = call.epoch();
  const int parity = call.parity();
  if (cfg.poison_outputs) {  // 0xFF.. is NaN in float32, bfloat16 and float16
    std::memset(p.out, 0xFF, static_cast<size_t>(tp * chunk_out) * elt);
    if (p.gathered) std::memset(p.gathered, 0xFF, tp * chunk_bytes);
  }

  // 1. Push the local chunk to every peer (copy-engine role on the GPU).
  for (int i = 1; i < tp; ++i) {
    const int peer = (rank + i) % tp;
    FLUX_JAX_RETURN_IF_ERROR(channel.Wait(rank, cpu::FlagKind::kFreed, parity, peer, epoch >= 2 ? epoch - 2 : 0, epoch,
                                          cfg, {"ag_matmul", peer, rank}));
    std::byte* slot = channel.Slot(peer, parity, rank);
    if (chunk_bytes) std::memcpy(slot, p.x, chunk_bytes);
    if (scale_bytes) std::memcpy(slot + chunk_bytes, p.fp8.row_scale, scale_bytes);
    if (rank != cfg.drop_rank) {
      channel.Signal(peer, cpu::FlagKind::kArrived, parity, rank, epoch, cfg);
    }
  }

  // 2. GEMM chunk by chunk, local first, each remote chunk once it arrived.
  const std::vector<float> w = p.fp8.on ? cpu::Fp8WeightAsFloat(p.w, p.k, p.n, p.fp8.col_scale)
                                        : cpu::WeightAsFloat(p.w, p.dtype, p.k, p.n, p.w_transposed);
  std::vector<float> acc(static_cast<size_t>(chunk_out));
  std::vector<float> received_scales(local_scales ? static_cast<size_t>(p.m_local) : 0);
  for (int i = 0; i < tp; ++i) {
    const int src = (rank + i) % tp;
    const void* rows = p.x;
    const float* row_scale = p.fp8.on ? p.fp8.row_scale + (local_scales ? 0 : src * p.m_local) : nullptr;
    if (src != rank) {
      FLUX_JAX_RETURN_IF_ERROR(
          channel.Wait(rank, cpu::FlagKind::kArrived, parity, src, epoch, epoch, cfg, {"ag_matmul", src, src}));
      rows = channel.Slot(rank, parity, src);
      if (local_scales) {
        std::memcpy(received_scales.data(), channel.Slot(rank, parity, src) + chunk_bytes, scale_bytes);
        row_scale = received_scales.data();
      }
    }
    if (p.fp8.on) {
      cpu::GemmRowsFp8(rows, p.fp8.x_e5m2, p.m_local, p.k, w.data(), p.n, row_scale, acc.data());
    } else {
      cpu::GemmRows(rows, p.dtype, p.m_local, p.k, w.data(), p.n, acc.data());
    }
    cpu::FromFloat(acc.data(), chunk_out, p.dtype, static_cast<char*>(p.out) + src * chunk_out * elt);
    if (p.gathered && chunk_bytes) {
      std::memcpy(static_cast<char*>(p.gathered) + src * chunk_bytes, rows, chunk_bytes);
    }
    if (src != rank) channel.Signal(src, cpu::FlagKind::kFreed, parity, rank, epoch, cfg);
  }
  return call.Finish(cfg, "ag_matmul");
}

}  // namespace flux_jax
