// The epilogue of the decode GEMM that reduce-scatters (matmul_rs's decode path,
// matmul_rs_decode.cu) or all-reduces (matmul_ar's, matmul_ar_decode.cu) its result
// tile by tile. Included by decode_gemm.cuh.
//
// One output tile (64 columns of N x all M rows: M <= the row tile) of rank r,
// after CUTLASS's epilogue has stored it into P with TMA:
//
//   consumer warpgroup (128 threads), thread t
//   warp 0: wait for the tile's TMA stores to be written; fence.proxy.async
//   for q != r:  q.ll[b][r][rows q sums][cols] = {P[..], e} words   (NVLink stores)
//   out[rows r sums][cols] = sum over q = 0..tp-1 of (q == r ? P : ll[b][q] once
//                            its words carry epoch e), in float32, rank order,
//                            rounded once
//
//   rows q sums: reduce-scatter, q's m / tp rows; all-reduce, all m rows (a
//   one-shot all-reduce: every rank gets every partial and sums them in the
//   same order, so out is bitwise the same on every rank). Rows go in blocks of
//   64, every block pushed to every peer before the first block is summed.
//
// The low-latency format (NCCL's "LL"): each 8-byte word holds 4 bytes of data
// and the low 32 bits of the call's epoch, written by one store, so a reader
// polls the data itself: no fence and no separate flag, one NVLink trip
// instead of a store, a system fence and a flag behind it. Thread t writes
// exactly the words that thread t of the receiver's warpgroup reads (same
// tile, same index), so each thread only ever waits for its own words. The
// area is written by nothing else and zeroed when allocated, so a stale word
// carries an older epoch (until the epoch wraps at 2^32 calls).
//
// Every rank runs the same grid over the same tiles, and a tile only ever
// waits for the same tile of its peers, which write before they wait: no
// cycle. Why a rank may overwrite q's slots (parity b = epoch & 1) in call
// e+2: its call e+1 waited for words that q's call e+1 wrote, after q's call e
// (the last reader of those slots) finished on q's stream; every path's call
// waits for every peer (latency_collectives.cu).
#pragma once

#include <cuda_bf16.h>

#include "cutlass/arch/barrier.h"
#include "decode_gemm.h"
#include "device_sync.cuh"

namespace flux_jax::cuda {

// One 16-byte low-latency word: data words d0, d1 with the epoch after each.
__device__ __forceinline__ void StoreLL(uint4* p, uint32_t d0, uint32_t d1, uint32_t epoch) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d0), "r"(epoch), "r"(d1), "r"(epoch)
               : "memory");
}

// One 16-byte low-latency word as it is now (L1 bypassed: a peer writes it over NVLink).
__device__ __forceinline__ uint4 LoadVolatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ void AddBf16x8(float* acc, uint4 v) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    acc[2 * j] += f.x;
    acc[2 * j + 1] += f.y;
  }
}

// This thread's vectors u < mine of a row block of P (L2: TMA wrote them), all loads in flight.
template <int kPer>
__device__ __forceinline__ void LoadMine(const uint4* src, const int64_t* offset, int32_t mine, uint4* val) {
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    if (u < mine) val[u] = __ldcg(src + offset[u]);
  }
}

// Rows a thread's kPer vectors cover in one pass (a block): the most rows of a reduce-scatter's rank.
inline constexpr int kExchangeBlockRows = static_cast<int>(kDecodeExchangeMaxRows / 2);

// One block's vectors that thread t (of kThreads) handles: vectors t, t + kThreads, ... of
// `rows` rows x `vecs` columns. Their offsets do not depend on the block's rows.
template <int kThreads>
__device__ __forceinline__ int32_t VectorsOf(int32_t rows, int32_t vecs, int t) {
  const int32_t count = rows * vecs;
  return count > t ? (count - t + kThreads - 1) / kThreads : 0;
}

// Thread t's vectors of rows [row0, row0 + rows) summed over the ranks in rank order
// (own partial for the rank itself, the low-latency words of every other rank once they carry
// the epoch) and written to out + row0's vectors; NaN where a wait gave up.
template <int kPer>
__device__ __forceinline__ void SumBlock(const DecodeExchange& e, const int64_t* offset, int32_t mine, int32_t row0,
                                         int64_t row_vecs, int32_t tile) {
  const uint32_t epoch = static_cast<uint32_t>(e.ctx.epoch);
  const auto* partial = static_cast<const uint4*>(e.partial);
  const auto* recv = static_cast<const uint4*>(e.recv);
  float acc[kPer][8] = {};
  bool ok = true;
#pragma unroll
  for (int q = 0; q < kDecodeMaxRanks; ++q) {  // rank order: the same sum on every rank, every run
    if (q >= e.tp) continue;
    if (q == e.rank) {
      const uint4* src = partial + (e.FirstRowOf(q) + row0) * row_vecs;
      uint4 val[kPer];
      LoadMine<kPer>(src, offset, mine, val);
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        if (u < mine) AddBf16x8(acc[u], val[u]);
      }
      continue;
    }
    const uint4* words = recv + 2 * (static_cast<int64_t>(q) * e.reduced_rows + row0) * row_vecs;
    uint32_t pending = (1u << mine) - 1;  // vectors whose words have not all carried the epoch
    WaitDeadline deadline;
    uint32_t seen = 0;
    while (pending != 0) {
      uint4 lo[kPer], hi[kPer];
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        if (pending & (1u << u)) {
          lo[u] = LoadVolatile(words + 2 * offset[u]);
          hi[u] = LoadVolatile(words + 2 * offset[u] + 1);
        }
      }
#pragma unroll
      for (int u = 0; u < kPer; ++u) {
        if (!(pending & (1u << u))) continue;
        if (lo[u].y == epoch && lo[u].w == epoch && hi[u].y == epoch && hi[u].w == epoch) {
          AddBf16x8(acc[u], make_uint4(lo[u].x, lo[u].z, hi[u].x, hi[u].z));
          pending &= ~(1u << u);
        } else {
          seen = lo[u].y;
        }
      }
      if (pending == 0) break;
      if (const int32_t how = deadline.Expired(e.ctx)) {
        const int32_t site = e.all_reduce ? kSiteDecodeAllReduce : kSiteDecodeSums;
        RecordGiveUp(e.ctx, how, site, q, -1, tile, seen);  // keeps an earlier record
        ok = false;
        break;
      }
    }
  }

  auto* out = static_cast<uint4*>(e.out) + row0 * row_vecs;
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    if (u >= mine) continue;
    uint4 result;
    auto* r = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
    for (int j = 0; j < 4; ++j) r[j] = __floats2bfloat162_rn(acc[u][2 * j], acc[u][2 * j + 1]);
    if (!ok) result = make_uint4(~0u, ~0u, ~0u, ~0u);  // bf16 NaN
    out[offset[u]] = result;
  }
}

// The exchange of one output tile by one consumer warpgroup (thread t < 128). Inlined: a call
// from the consumer warpgroup (after setmaxnreg) made ptxas fail to allocate its 232 registers.
// A thread handles up to kPer vectors of a row block and issues all their loads before it uses
// any (one memory latency per step instead of one per vector). Measured in the kernel on 2x H200
// (64 x 4096 x 8192 per GPU, reduce-scatter): the exchange adds 4.5 us at 64 rows (6.0 as a loop
// of dependent loads), 12.3 at 128 rows (13.1), where each thread has four vectors.
template <int kTileCols>
__device__ __forceinline__ void ExchangeTile(const DecodeExchange& e, int32_t tile, int t) {
  constexpr int kThreads = 128;
  constexpr int kPer = kExchangeBlockRows * (kTileCols / 8) / kThreads;
  if (t < 32) {  // the warp that issued the tile's TMA stores: wait until they are written
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  cutlass::arch::NamedBarrier::sync(kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
  const int64_t row_vecs = e.n / 8;  // 16-byte vectors per row (n % 8 == 0)
  const int32_t c0 = tile * (kTileCols / 8);
  const int32_t vecs = min(kTileCols / 8, static_cast<int32_t>(row_vecs) - c0);
  const int32_t blocks = (e.reduced_rows + kExchangeBlockRows - 1) / kExchangeBlockRows;
  const uint32_t epoch = static_cast<uint32_t>(e.ctx.epoch);
  const auto* partial = static_cast<const uint4*>(e.partial);
  // Vector u of this thread in a block: offset (row * row_vecs + column) from the block's first row.
  int64_t offset[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int32_t i = t + u * kThreads, row = i / vecs;
    offset[u] = row * row_vecs + c0 + (i - row * vecs);
  }
  auto mine_in = [&](int32_t j) {
    return VectorsOf<kThreads>(min(kExchangeBlockRows, e.reduced_rows - j * kExchangeBlockRows), vecs, t);
  };

  if (e.signal_peers) {
#pragma unroll 1
    for (int32_t j = 0; j < blocks; ++j) {
      const int32_t mine = mine_in(j), row0 = j * kExchangeBlockRows;
#pragma unroll
      for (int q = 0; q < kDecodeMaxRanks; ++q) {
        if (q >= e.tp || q == e.rank) continue;
        const uint4* src = partial + (e.FirstRowOf(q) + row0) * row_vecs;
        auto* dst = static_cast<uint4*>(e.peer_recv[q]) + 2 * row0 * row_vecs;
        uint4 val[kPer];
        LoadMine<kPer>(src, offset, mine, val);
#pragma unroll
        for (int u = 0; u < kPer; ++u) {
          if (u < mine) {
            StoreLL(dst + 2 * offset[u], val[u].x, val[u].y, epoch);
            StoreLL(dst + 2 * offset[u] + 1, val[u].z, val[u].w, epoch);
          }
        }
      }
    }
  }
#pragma unroll 1
  for (int32_t j = 0; j < blocks; ++j) SumBlock<kPer>(e, offset, mine_in(j), j * kExchangeBlockRows, row_vecs, tile);
}

template <class Base>
struct ExchangingEpilogue : Base {
  using typename Base::LoadPipeline;
  using typename Base::LoadPipelineState;
  using typename Base::StorePipeline;
  using typename Base::StorePipelineState;
  using typename Base::TensorStorage;

  struct Arguments : Base::Arguments {
    DecodeExchange exchange;
  };
  struct Params : Base::Params {
    DecodeExchange exchange;
  };

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                                  void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    params.exchange = args.exchange;
    return params;
  }

  CUTLASS_HOST_DEVICE ExchangingEpilogue(Params const& params, TensorStorage& shared_tensors)
      : Base(params, shared_tensors), exchange_(&params.exchange) {}

  // Consumer warpgroup, once per work tile: remembers the tile for store_tail.
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class Accumulators, class TiledMma,
            class... Rest>
  CUTLASS_DEVICE auto store(LoadPipeline load_pipeline, LoadPipelineState load_pipe_consumer_state,
                            StorePipeline store_pipeline, StorePipelineState store_pipe_producer_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, Accumulators accumulators, TiledMma tiled_mma,
                            int thread_idx, TensorStorage& shared_tensors, Rest... rest) {
    tile_ = static_cast<int32_t>(cute::get<0>(tile_coord_mnkl));
    thread_ = thread_idx;
    return Base::store(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
                       problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl, accumulators, tiled_mma, thread_idx,
                       shared_tensors, rest...);
  }

  // Consumer warpgroup, after each tile's store (the ping-pong kernel calls it per tile).
  CUTLASS_DEVICE auto store_tail(LoadPipeline load_pipeline, LoadPipelineState load_pipe_consumer_state,
                                 StorePipeline store_pipeline, StorePipelineState store_pipe_producer_state) {
    auto states = Base::store_tail(load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state);
    if (exchange_->tp > 0 && tile_ >= 0) ExchangeTile<kTileCols>(*exchange_, tile_, thread_);
    tile_ = -1;
    return states;
  }

 private:
  static constexpr int kTileCols = cute::size<0>(typename Base::CtaTileMNK{});

  DecodeExchange const* exchange_;
  int32_t tile_ = -1;
  int thread_ = 0;
};

}  // namespace flux_jax::cuda
