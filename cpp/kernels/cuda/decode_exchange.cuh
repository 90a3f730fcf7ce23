// The epilogue of the decode GEMM that reduce-scatters its result tile by tile
// (matmul_rs's decode path, matmul_rs_decode.cu). Included by decode_gemm.cuh.
//
// One output tile (64 columns of N x all M rows: M <= the row tile) of rank r,
// after CUTLASS's epilogue has stored it into P with TMA:
//
//   consumer warpgroup (128 threads), thread t
//   warp 0: wait for the tile's TMA stores to be written; fence.proxy.async
//   for q != r:  q.ll[b][r][rows of q][cols] = {P[..], e} words    (NVLink stores)
//   out[rows of r][cols] = sum over q = 0..tp-1 of (q == r ? P : ll[b][q] once
//                          its words carry epoch e), in float32, rank order,
//                          rounded once
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
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d0), "r"(epoch), "r"(d1),
               "r"(epoch)
               : "memory");
}

// Spins until both halves of the word at p carry `epoch`; false (recorded) on timeout.
__device__ __forceinline__ bool LoadLL(const uint4* p, uint32_t epoch, uint32_t* d0, uint32_t* d1,
                                       const WaitContext& ctx, int32_t peer, int32_t tile) {
  WaitDeadline deadline;
  for (;;) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    if (v.y == epoch && v.w == epoch) {
      *d0 = v.x;
      *d1 = v.z;
      return true;
    }
    if (deadline.Expired(ctx)) {
      if (*reinterpret_cast<volatile int32_t*>(&ctx.error->code) == 0) {
        RecordTimeout(ctx, kSiteDecodeSums, peer, -1, tile, v.y != epoch ? v.y : v.w);
      }
      return false;
    }
  }
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

// The exchange of one output tile by one consumer warpgroup (thread t < 128). Inlined: a call
// from the consumer warpgroup (after setmaxnreg) made ptxas fail to allocate its 232 registers.
template <int kTileCols>
__device__ __forceinline__ void ExchangeTile(const DecodeExchange& e, int32_t tile, int t) {
  constexpr int kThreads = 128;
  if (t < 32) {  // the warp that issued the tile's TMA stores: wait until they are written
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  cutlass::arch::NamedBarrier::sync(kThreads, cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
  const int64_t row_vecs = e.n / 8;  // 16-byte vectors per row (n % 8 == 0)
  const int32_t c0 = tile * (kTileCols / 8);
  const int32_t vecs = min(kTileCols / 8, static_cast<int32_t>(row_vecs) - c0);
  const int32_t rpr = e.rows_per_rank;
  const uint32_t epoch = static_cast<uint32_t>(e.ctx.epoch);
  const auto* partial = static_cast<const uint4*>(e.partial);

  if (e.signal_peers) {
#pragma unroll
    for (int q = 0; q < kDecodeMaxRanks; ++q) {
      if (q >= e.tp || q == e.rank) continue;
      auto* dst = static_cast<uint4*>(e.peer_recv[q]);
      for (int32_t i = t; i < rpr * vecs; i += kThreads) {
        const int32_t row = i / vecs, v = c0 + (i - row * vecs);
        const uint4 val = __ldcg(partial + (q * rpr + row) * row_vecs + v);
        uint4* word = dst + 2 * (row * row_vecs + v);
        StoreLL(word, val.x, val.y, epoch);
        StoreLL(word + 1, val.z, val.w, epoch);
      }
    }
  }

  const auto* recv = static_cast<const uint4*>(e.recv);
  auto* out = static_cast<uint4*>(e.out);
  for (int32_t i = t; i < rpr * vecs; i += kThreads) {
    const int32_t row = i / vecs, v = c0 + (i - row * vecs);
    float acc[8] = {};
    bool ok = true;
#pragma unroll
    for (int q = 0; q < kDecodeMaxRanks; ++q) {  // rank order: the same sum on every rank, every run
      if (q >= e.tp) continue;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (q == e.rank) {
        val = __ldcg(partial + (e.rank * rpr + row) * row_vecs + v);
      } else {
        const uint4* word = recv + 2 * ((q * rpr + row) * row_vecs + v);
        ok = ok && LoadLL(word, epoch, &val.x, &val.y, e.ctx, q, tile) &&
             LoadLL(word + 1, epoch, &val.z, &val.w, e.ctx, q, tile);
      }
      AddBf16x8(acc, val);
    }
    uint4 result;
    auto* r = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
    for (int j = 0; j < 4; ++j) r[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    if (!ok) result = make_uint4(~0u, ~0u, ~0u, ~0u);  // bf16 NaN
    out[row * row_vecs + v] = result;
  }
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
