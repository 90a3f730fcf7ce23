// The epilogue of the decode GEMM that reduce-scatters its result tile by tile
// (matmul_rs's decode path, matmul_rs_decode.cu). Included by decode_gemm.cuh.
//
// One output tile (64 columns of N x all M rows: M <= the row tile) of rank r,
// after CUTLASS's epilogue has stored it into P with TMA:
//
//   consumer warpgroup (128 threads)
//   warp 0: wait for the tile's TMA stores to be written; fence.proxy.async
//   for q != r:  q.recv[r][rows of q][cols] = P[rows of q][cols]   (NVLink stores)
//   fence.sys;   q.flag[r][tile] = epoch                           (st.release.sys)
//   wait flag[q][tile] >= epoch for every q != r                   (bounded)
//   out[rows of r][cols] = sum over q = 0..tp-1 of (q == r ? P : recv[q])
//                          in float32, rank order, rounded once
//
// Every rank runs the same grid over the same tiles, and a tile only ever
// waits for the same tile of its peers, which raise their flag before they
// wait: no cycle. The tile is one wave's worth of work, so the exchange costs
// each tile a few microseconds of NVLink latency instead of a separate
// collective kernel after the GEMM (the latency path's ~9.5 us).
//
// Why a rank may overwrite q.recv (parity b = epoch & 1) of call e+2: its call
// e+1 waited, for this very tile, for q's flag of e+1, which q raises after its
// call e (the last reader of that slot) finished on q's stream.
#pragma once

#include <cuda_bf16.h>

#include "cutlass/arch/barrier.h"
#include "decode_gemm.h"
#include "device_sync.cuh"
#include "nvlink_stores.cuh"

namespace flux_jax::cuda {

// bar.red.and over a named barrier: every participant gets the AND of `pred`.
template <uint32_t kId, uint32_t kThreads>
__device__ __forceinline__ bool NamedBarrierAnd(bool pred) {
  uint32_t result;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, %3, p;\n"
      " selp.u32 %0, 1, 0, q;\n}"
      : "=r"(result)
      : "r"(static_cast<uint32_t>(pred)), "n"(kId), "n"(kThreads)
      : "memory");
  return result != 0;
}

// The exchange of one output tile by one consumer warpgroup (thread t < 128).
template <int kTileCols>
__device__ __forceinline__ void ExchangeTile(const DecodeExchange& e, int32_t tile, int t) {
  constexpr int kThreads = 128;
  constexpr uint32_t kBarrier = static_cast<uint32_t>(cutlass::arch::ReservedNamedBarriers::EpilogueBarrier);
  using Vec = uint4;  // 8 bf16
  if (t < 32) {  // the warp that issued the tile's TMA stores: wait until they are written
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  cutlass::arch::NamedBarrier::sync(kThreads, kBarrier);
  const int64_t n = e.n;
  const int32_t c0 = tile * kTileCols;
  const int32_t vecs = (min(kTileCols, e.n - c0)) / 8;  // n % 8 == 0
  const int32_t rpr = e.rows_per_rank;
  const auto* partial = static_cast<const __nv_bfloat16*>(e.partial);

#pragma unroll
  for (int q = 0; q < kDecodeMaxRanks; ++q) {
    if (q >= e.tp || q == e.rank) continue;
    auto* dst = static_cast<__nv_bfloat16*>(e.peer_recv[q]);
    for (int32_t i = t; i < rpr * vecs; i += kThreads) {
      const int32_t row = i / vecs, v = i - row * vecs;
      const Vec val = __ldcg(reinterpret_cast<const Vec*>(partial + (q * rpr + row) * n + c0) + v);
      reinterpret_cast<Vec*>(dst + row * n + c0)[v] = val;
    }
  }
  __threadfence_system();
  cutlass::arch::NamedBarrier::sync(kThreads, kBarrier);
  if (t == 0 && e.signal_peers) {
#pragma unroll
    for (int q = 0; q < kDecodeMaxRanks; ++q) {
      if (q < e.tp && q != e.rank) StoreReleaseSys(e.peer_flag[q] + tile, e.ctx.epoch);
    }
  }

  bool ok = true;
  if (t == 0) {
    for (int q = 0; q < e.tp; ++q) {
      if (q != e.rank) ok = WaitFlagInline(e.my_flags + q * e.flag_stride + tile, e.ctx, kSiteDecodeSums, q, -1, tile) && ok;
    }
  }
  ok = NamedBarrierAnd<kBarrier, kThreads>(ok);

  const auto* recv = static_cast<const __nv_bfloat16*>(e.recv);
  auto* out = static_cast<__nv_bfloat16*>(e.out);
  for (int32_t i = t; i < rpr * vecs; i += kThreads) {
    const int32_t row = i / vecs, v = i - row * vecs;
    float acc[8] = {};
#pragma unroll
    for (int q = 0; q < kDecodeMaxRanks; ++q) {  // rank order: the same sum on every rank, every run
      if (q >= e.tp) continue;
      const __nv_bfloat16* src = q == e.rank ? partial + (e.rank * rpr + row) * n : recv + (q * rpr + row) * n;
      Vec val = __ldcg(reinterpret_cast<const Vec*>(src + c0) + v);
      const auto* h = reinterpret_cast<const __nv_bfloat162*>(&val);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        acc[2 * j] += f.x;
        acc[2 * j + 1] += f.y;
      }
    }
    Vec result;
    auto* r = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
    for (int j = 0; j < 4; ++j) r[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    if (!ok) result = make_uint4(~0u, ~0u, ~0u, ~0u);  // bf16 NaN
    reinterpret_cast<Vec*>(out + row * n + c0)[v] = result;
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
