// Low-latency collectives on the CPU backend (the latency path's protocol
// reference; see flux_jax/collectives.h). Same channel protocol as the fused
// ops: push into the peer's slot, signal arrived, the receiver frees the slot.
//
//   all_gather, rank r:      push x -> every peer's slot[r]; out[r] = x;
//                            out[q] = slot[q] once arrived[q] >= epoch
//   reduce_scatter, rank r:  push x[chunk q] -> peer q's slot[r];
//                            out = sum over q = 0..tp-1 of (q == r ? x[chunk r] : slot[q]),
//                            accumulated in float32 in rank order (bitwise reproducible)
//   all_reduce, rank r:      push x -> every peer's slot[r];
//                            out = sum over q = 0..tp-1 of (q == r ? x : slot[q]), in float32
//                            in rank order: the same bits on every rank
#include <cstring>
#include <vector>

#include "channel.h"
#include "flux_jax/collectives.h"
#include "host_gemm.h"

namespace flux_jax {
namespace {

// Pushes `src_of(peer)` (chunk_bytes) into every peer's slot, signalling each.
template <typename SrcOf>
Status PushToPeers(cpu::Channel& channel, int rank, int tp, int parity, uint64_t epoch, size_t chunk_bytes,
                   const CommConfig& cfg, const char* op, SrcOf src_of) {
  for (int i = 1; i < tp; ++i) {
    const int peer = (rank + i) % tp;
    FLUX_JAX_RETURN_IF_ERROR(channel.Wait(rank, cpu::FlagKind::kFreed, parity, peer, epoch >= 2 ? epoch - 2 : 0, epoch,
                                          cfg, {op, peer, rank}));
    if (chunk_bytes) std::memcpy(channel.Slot(peer, parity, rank), src_of(peer), chunk_bytes);
    if (rank != cfg.drop_rank) channel.Signal(peer, cpu::FlagKind::kArrived, parity, rank, epoch, cfg);
  }
  return Status::Ok();
}

// out (elems values of `dtype`) = the sum over ranks in rank order, in float32, of this rank's
// `own` values and each peer's from its receive slot (freed after use): the same bits wherever
// the same values meet. `chunk_of(src)`: the chunk a timed-out wait names.
template <typename ChunkOf>
Status SumInRankOrder(cpu::Channel& channel, int rank, int tp, int parity, uint64_t epoch, const void* own,
                      int64_t elems, DType dtype, const CommConfig& cfg, const char* op, ChunkOf chunk_of, void* out) {
  std::vector<float> acc(static_cast<size_t>(elems), 0.0f), part(acc.size());
  for (int src = 0; src < tp; ++src) {
    const void* rows = own;
    if (src != rank) {
      FLUX_JAX_RETURN_IF_ERROR(
          channel.Wait(rank, cpu::FlagKind::kArrived, parity, src, epoch, epoch, cfg, {op, src, chunk_of(src)}));
      rows = channel.Slot(rank, parity, src);
    }
    cpu::ToFloat(rows, dtype, elems, part.data());
    for (int64_t i = 0; i < elems; ++i) acc[i] += part[i];
    if (src != rank) channel.Signal(src, cpu::FlagKind::kFreed, parity, rank, epoch, cfg);
  }
  cpu::FromFloat(acc.data(), elems, dtype, out);
  return Status::Ok();
}

}  // namespace

Status RunAllGatherCpu(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg) {
  FLUX_JAX_RETURN_IF_ERROR(AllGatherCanImplement(p, group));
  const int tp = group.size, rank = group.rank;
  const size_t chunk_bytes = static_cast<size_t>(p.rows * p.cols) * DTypeBytes(p.dtype);
  const uint64_t signature = cpu::HashInts({3, p.rows, p.cols, static_cast<int64_t>(p.dtype)});
  cpu::ChannelCall call;
  FLUX_JAX_RETURN_IF_ERROR(call.Open(group, cfg, chunk_bytes, signature));
  cpu::Channel& channel = call.channel();
  const uint64_t epoch = call.epoch();
  const int parity = call.parity();
  auto* out = static_cast<char*>(p.out);
  if (cfg.poison_outputs) std::memset(out, 0xFF, tp * chunk_bytes);

  FLUX_JAX_RETURN_IF_ERROR(
      PushToPeers(channel, rank, tp, parity, epoch, chunk_bytes, cfg, "all_gather", [&](int) { return p.x; }));
  if (chunk_bytes) std::memcpy(out + rank * chunk_bytes, p.x, chunk_bytes);
  for (int i = 1; i < tp; ++i) {
    const int src = (rank + i) % tp;
    FLUX_JAX_RETURN_IF_ERROR(
        channel.Wait(rank, cpu::FlagKind::kArrived, parity, src, epoch, epoch, cfg, {"all_gather", src, src}));
    if (chunk_bytes) std::memcpy(out + src * chunk_bytes, channel.Slot(rank, parity, src), chunk_bytes);
    channel.Signal(src, cpu::FlagKind::kFreed, parity, rank, epoch, cfg);
  }
  return call.Finish(cfg, "all_gather");
}

Status RunReduceScatterCpu(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg) {
  FLUX_JAX_RETURN_IF_ERROR(ReduceScatterCanImplement(p, group));
  const int tp = group.size, rank = group.rank;
  const size_t elt = DTypeBytes(p.dtype);
  const int64_t chunk_elems = p.rows / tp * p.cols;
  const size_t chunk_bytes = static_cast<size_t>(chunk_elems) * elt;
  const uint64_t signature = cpu::HashInts({4, p.rows, p.cols, static_cast<int64_t>(p.dtype)});
  cpu::ChannelCall call;
  FLUX_JAX_RETURN_IF_ERROR(call.Open(group, cfg, chunk_bytes, signature));
  cpu::Channel& channel = call.channel();
  const uint64_t epoch = call.epoch();
  const int parity = call.parity();
  if (cfg.poison_outputs) std::memset(p.out, 0xFF, chunk_bytes);
  auto chunk = [&](int q) { return static_cast<const char*>(p.x) + q * chunk_bytes; };

  FLUX_JAX_RETURN_IF_ERROR(PushToPeers(channel, rank, tp, parity, epoch, chunk_bytes, cfg, "reduce_scatter", chunk));
  FLUX_JAX_RETURN_IF_ERROR(SumInRankOrder(
      channel, rank, tp, parity, epoch, chunk(rank), chunk_elems, p.dtype, cfg, "reduce_scatter",
      [&](int) { return rank; }, p.out));
  return call.Finish(cfg, "reduce_scatter");
}

Status RunAllReduceCpu(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg) {
  FLUX_JAX_RETURN_IF_ERROR(AllReduceCanImplement(p, group));
  const int tp = group.size, rank = group.rank;
  const int64_t elems = p.rows * p.cols;
  const size_t bytes = static_cast<size_t>(elems) * DTypeBytes(p.dtype);
  const uint64_t signature = cpu::HashInts({5, p.rows, p.cols, static_cast<int64_t>(p.dtype)});
  cpu::ChannelCall call;
  FLUX_JAX_RETURN_IF_ERROR(call.Open(group, cfg, bytes, signature));
  cpu::Channel& channel = call.channel();
  const uint64_t epoch = call.epoch();
  const int parity = call.parity();
  if (cfg.poison_outputs) std::memset(p.out, 0xFF, bytes);

  FLUX_JAX_RETURN_IF_ERROR(
      PushToPeers(channel, rank, tp, parity, epoch, bytes, cfg, "all_reduce", [&](int) { return p.x; }));
  // Rank order on every rank: the same sum everywhere.
  FLUX_JAX_RETURN_IF_ERROR(SumInRankOrder(
      channel, rank, tp, parity, epoch, p.x, elems, p.dtype, cfg, "all_reduce", [](int src) { return src; }, p.out));
  return call.Finish(cfg, "all_reduce");
}

}  // namespace flux_jax
