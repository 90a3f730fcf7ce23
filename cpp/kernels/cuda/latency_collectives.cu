// Latency-path collectives: one kernel per call, rows moved with SM stores over
// NVLink, per-block epoch flags, no host work beyond the launch.
//
// Every rank launches the same grid over the same chunk size, so block i of
// every rank owns the same byte range [lo_i, hi_i) of a chunk. Block i only
// ever waits for block i of its peers, never for the whole grid:
//
//   all_gather, rank r, block i                 reduce_scatter, rank r, block i
//   ------------------------------------------  --------------------------------------------
//   v = x[lo_i:hi_i]                            for peer p != r:
//   out[chunk r][lo_i:hi_i] = v                   peer p.slot[b][r][lo_i:hi_i] = x[chunk p][..]
//   peer p.slot[b][r][lo_i:hi_i] = v  (NVLink)  bar, fence.sys; peer p.flag[r][i] = epoch
//   bar, fence.sys; peer p.flag[r][i] = epoch   wait flag[q][i] >= epoch for every q != r
//   wait flag[q][i] >= epoch, q != r            out[lo_i:hi_i] = sum over q = 0..tp-1 in rank
//   out[chunk q][lo_i:hi_i] = slot[b][q][..]      order of (q == r ? x[chunk r] : slot[b][q]),
//                                                 in float32, rounded once
//
//   all_reduce, rank r, block i: as reduce_scatter with the whole x as every peer's chunk:
//   v = x[lo_i:hi_i]; peer p.slot[b][r][lo_i:hi_i] = v for every peer p (one load, tp - 1 stores);
//   bar, fence.sys; peer p.flag[r][i] = epoch; wait flag[q][i] >= epoch for every q != r;
//   out[lo_i:hi_i] = sum over q = 0..tp-1 in rank order of (q == r ? x : slot[b][q]), in float32,
//   rounded once: every rank adds the same values in the same order, so all hold the same bits.
//
// b = epoch & 1 (double-buffered slots). Why a sender may overwrite slot[b] of
// call e+2 without asking: it starts call e+2 only after its call e+1 saw the
// peer's flags of e+1, which the peer raises in its kernel e+1, i.e. after its
// kernel e (the last reader of slot[b]) has finished on its stream.
// The two parities are the two fixed halves of the slot area, whatever a call's
// size: with a size-dependent stride (tp * chunk bytes, until 2026-11-30) a call
// e+1 at least 1.5x smaller than call e wrote into the part of parity 0 that the
// peer's kernel e may still be reading. The halves cannot move under a call:
// the area only grows with every member drained (workspace.h), and every member
// has the same capacity (same requests in one process; the smallest in IPC).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "all_reduce.h"
#include "cuda_util.h"
#include "device_sync.cuh"
#include "flux_jax/collectives.h"
#include "flux_jax/limits.h"
#include "nvlink_stores.cuh"
#include "workspace.h"

namespace flux_jax::cuda {
namespace {

constexpr int kThreads = 512;
// Peer tables are indexed with compile-time indices only (unrolled loops), so
// the kernel parameters are never copied to local memory.
constexpr int kMaxPeers = limits::kLatencyMaxTp;
// A block moves at least one 16-byte vector per thread (8 KiB), so a small
// chunk spreads over many SMs (512 KiB: 64 blocks, not 16). Measured with the
// batching below (2x H200, 11-30): decode-loop times unchanged within noise;
// the call's fixed ~9.5 us dominates there (docs/kernels.md, "The latency path").
constexpr int64_t kMinBytesPerBlock = kThreads * 16;
// Vectors a thread loads before it stores them: the loads of one batch are in
// flight together instead of one HBM round trip per vector.
constexpr int kBatch = 4;

struct CollectiveArgs {
  const uint4* x;
  uint4* out;
  uint4* peer_slot[kMaxPeers];     // my chunk's slot on each peer (null for me)
  uint64_t* peer_flag[kMaxPeers];  // peer's block_arrived row for sender `rank`
  const uint4* my_slots;           // slot[b][0] of my own area; sender q at q * chunk_vecs
  const uint64_t* my_flags;        // my block_arrived, [sender][block]
  int64_t chunk_vecs;              // 16-byte vectors per chunk
  int32_t tp, rank;
  bool signal;  // false: debug_drop_rank (tests the timeout path)
  int32_t site;
  WaitContext ctx;
};

// After this block's stores: raise its flag on every peer.
__device__ __forceinline__ void SignalPeers(const CollectiveArgs& a) {
  __syncthreads();
  if (threadIdx.x == 0 && a.signal) {
    FenceAcqRelSys();  // one fence for the whole block (nvlink_stores.cuh)
#pragma unroll
    for (int p = 0; p < kMaxPeers; ++p) {
      if (p < a.tp && p != a.rank) StoreRelaxedSys(a.peer_flag[p] + blockIdx.x, a.ctx.epoch);
    }
  }
}

// Waits for block blockIdx.x of sender q; false (recorded, poisoned) on timeout.
__device__ __forceinline__ bool WaitSender(const CollectiveArgs& a, int q) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    const WaitContext ctx = a.ctx;  // WaitFlag takes a reference: copy only this, not all of `a`
    ok =
        WaitFlag(a.my_flags + q * kMaxLatencyBlocks + blockIdx.x, ctx, a.site, q, -1, static_cast<int32_t>(blockIdx.x));
  }
  __syncthreads();
  const bool result = ok != 0;
  __syncthreads();  // `ok` is reused by the next wait
  return result;
}

// All bits set: NaN in every float format the kernels move (f32, bf16, f16, FP8 e4m3fn / e5m2).
__device__ __forceinline__ uint4 NaN16() { return make_uint4(~0u, ~0u, ~0u, ~0u); }

template <class Load, class Store>
__device__ __forceinline__ void BatchedCopy(int64_t lo, int64_t hi, Load load, Store store) {
  cuda::BatchedCopy<kThreads, kBatch>(lo, hi, load, store);
}

__global__ void __launch_bounds__(kThreads) AllGatherKernel(CollectiveArgs a) {
  int64_t lo, hi;
  BlockRange(a.chunk_vecs, &lo, &hi);
  uint4* own = a.out + a.rank * a.chunk_vecs;
  BatchedCopy(
      lo, hi, [&](int64_t v) { return __ldg(a.x + v); },
      [&](int64_t v, uint4 val) {
        own[v] = val;
#pragma unroll
        for (int p = 0; p < kMaxPeers; ++p) {
          if (p < a.tp && p != a.rank) a.peer_slot[p][v] = val;
        }
      });
  SignalPeers(a);
  for (int i = 1; i < a.tp; ++i) {
    const int q = (a.rank + i) % a.tp;
    const bool ok = WaitSender(a, q);
    const uint4* src = a.my_slots + q * a.chunk_vecs;
    uint4* dst = a.out + q * a.chunk_vecs;
    BatchedCopy(lo, hi, [&](int64_t v) { return ok ? src[v] : NaN16(); }, [&](int64_t v, uint4 val) { dst[v] = val; });
  }
}

template <typename T>
struct Pair;
template <>
struct Pair<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ float2 ToFloat2(uint32_t u) { return __bfloat1622float2(*reinterpret_cast<T2*>(&u)); }
  static __device__ uint32_t FromFloat2(float2 f) {
    T2 h = __floats2bfloat162_rn(f.x, f.y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};
template <>
struct Pair<__half> {
  using T2 = __half2;
  static __device__ float2 ToFloat2(uint32_t u) { return __half22float2(*reinterpret_cast<T2*>(&u)); }
  static __device__ uint32_t FromFloat2(float2 f) {
    T2 h = __floats2half2_rn(f.x, f.y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <typename T>
__global__ void __launch_bounds__(kThreads) ReduceScatterKernel(CollectiveArgs a) {
  int64_t lo, hi;
  BlockRange(a.chunk_vecs, &lo, &hi);
#pragma unroll
  for (int p = 0; p < kMaxPeers; ++p) {
    if (p >= a.tp || p == a.rank) continue;
    const uint4* src = a.x + p * a.chunk_vecs;
    uint4* dst = a.peer_slot[p];
    BatchedCopy(lo, hi, [&](int64_t v) { return __ldg(src + v); }, [&](int64_t v, uint4 val) { dst[v] = val; });
  }
  SignalPeers(a);
  bool ok = true;
  for (int q = 0; q < a.tp; ++q) {
    if (q != a.rank) ok = WaitSender(a, q) && ok;
  }
  const uint4* own = a.x + a.rank * a.chunk_vecs;
  for (int64_t base = lo + threadIdx.x; base < hi; base += int64_t{kThreads} * kBatch) {
    float2 acc[kBatch][4] = {};
    for (int q = 0; q < a.tp; ++q) {  // rank order: the same sum on every rank, every run
      const uint4* src = q == a.rank ? own : a.my_slots + q * a.chunk_vecs;
      uint4 val[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {  // the batch's loads first, all in flight together
        const int64_t v = base + int64_t{u} * kThreads;
        if (v < hi) val[u] = q == a.rank ? __ldg(src + v) : src[v];
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const uint32_t w[4] = {val[u].x, val[u].y, val[u].z, val[u].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = Pair<T>::ToFloat2(w[j]);
          acc[u][j].x += f.x;
          acc[u][j].y += f.y;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t v = base + int64_t{u} * kThreads;
      if (v >= hi) continue;
      uint4 r;
      r.x = Pair<T>::FromFloat2(acc[u][0]);
      r.y = Pair<T>::FromFloat2(acc[u][1]);
      r.z = Pair<T>::FromFloat2(acc[u][2]);
      r.w = Pair<T>::FromFloat2(acc[u][3]);
      a.out[v] = ok ? r : NaN16();
    }
  }
}

// out[lo, hi) = the rank-ordered float32 sum of own[lo, hi) (rank a.rank) and the peers'
// slots, rounded once; NaN where a peer's block never arrived (`ok` false).
template <typename T>
__device__ __forceinline__ void SumInRankOrder(const CollectiveArgs& a, const uint4* own, int64_t lo, int64_t hi,
                                               bool ok) {
  for (int64_t base = lo + threadIdx.x; base < hi; base += int64_t{kThreads} * kBatch) {
    float2 acc[kBatch][4] = {};
    for (int q = 0; q < a.tp; ++q) {  // rank order: the same sum on every rank, every run
      const uint4* src = q == a.rank ? own : a.my_slots + q * a.chunk_vecs;
      uint4 val[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {  // the batch's loads first, all in flight together
        const int64_t v = base + int64_t{u} * kThreads;
        if (v < hi) val[u] = q == a.rank ? __ldg(src + v) : src[v];
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const uint32_t w[4] = {val[u].x, val[u].y, val[u].z, val[u].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f = Pair<T>::ToFloat2(w[j]);
          acc[u][j].x += f.x;
          acc[u][j].y += f.y;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t v = base + int64_t{u} * kThreads;
      if (v >= hi) continue;
      uint4 r;
      r.x = Pair<T>::FromFloat2(acc[u][0]);
      r.y = Pair<T>::FromFloat2(acc[u][1]);
      r.z = Pair<T>::FromFloat2(acc[u][2]);
      r.w = Pair<T>::FromFloat2(acc[u][3]);
      a.out[v] = ok ? r : NaN16();
    }
  }
}

// One-shot all_reduce: every rank pushes its whole x into every peer's slot, then sums all tp.
template <typename T>
__global__ void __launch_bounds__(kThreads) AllReduceKernel(CollectiveArgs a) {
  int64_t lo, hi;
  BlockRange(a.chunk_vecs, &lo, &hi);
  BatchedCopy(
      lo, hi, [&](int64_t v) { return __ldg(a.x + v); },
      [&](int64_t v, uint4 val) {
#pragma unroll
        for (int p = 0; p < kMaxPeers; ++p) {
          if (p < a.tp && p != a.rank) a.peer_slot[p][v] = val;
        }
      });
  SignalPeers(a);
  bool ok = true;
  for (int q = 0; q < a.tp; ++q) {
    if (q != a.rank) ok = WaitSender(a, q) && ok;
  }
  SumInRankOrder<T>(a, a.x, lo, hi, ok);
}

enum class Kind { kAllGather, kReduceScatter };

Status Run(Kind kind, const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg, void* stream_ptr) {
  const char* name = kind == Kind::kAllGather ? "all_gather" : "reduce_scatter";
  // The all_gather copies bytes (FP8 payloads, float32 scales); the reduce_scatter sums pairs.
  if (kind == Kind::kReduceScatter && p.dtype != DType::kBF16 && p.dtype != DType::kF16) {
    return Status::InvalidArgument(std::string(name) + ": the CUDA kernel sums bfloat16 or float16, not " +
                                   DTypeName(p.dtype));
  }
  auto S = static_cast<cudaStream_t>(stream_ptr);
  const int tp = group.size, r = group.rank;
  const int device = group.ordinals[r];
  DeviceGuard guard(device);
  const size_t elt = DTypeBytes(p.dtype);
  const int64_t chunk_rows = kind == Kind::kAllGather ? p.rows : p.rows / tp;
  const size_t chunk_bytes = static_cast<size_t>(chunk_rows * p.cols) * elt;
  if (chunk_bytes % sizeof(uint4) != 0 || reinterpret_cast<uintptr_t>(p.x) % 16 ||
      reinterpret_cast<uintptr_t>(p.out) % 16) {
    return Status::InvalidArgument(std::string(name) + ": a rank's " + std::to_string(chunk_rows) + " rows of " +
                                   std::to_string(p.cols) + " " + DTypeName(p.dtype) +
                                   " elements are not a multiple of 16 bytes (the kernel moves 16-byte vectors)");
  }
  const size_t out_bytes = kind == Kind::kAllGather ? tp * chunk_bytes : chunk_bytes;
  if (tp > kMaxPeers) {
    return Status::InvalidArgument(std::string(name) + ": the latency path supports TP <= " +
                                   std::to_string(kMaxPeers) + ", got " + std::to_string(tp));
  }
  if (tp == 1) {
    if (out_bytes) FLUX_CUDA_TRY(cudaMemcpyAsync(p.out, p.x, out_bytes, cudaMemcpyDeviceToDevice, S));
    return Status::Ok();
  }
  // Nothing to move (every rank has the same empty shape): no kernel, and no epoch either, since
  // the slot-reuse argument above needs every epoch's call to have waited for its peers.
  if (chunk_bytes == 0) return Status::Ok();
  GroupWorkspace* ws = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(AcquireWorkspace(group, 0, cfg, S, &ws, 2 * tp * chunk_bytes));
  ws->epoch += 1;  // every rank counts every fused call of the group: epochs agree
  if (cfg.poison_outputs) FLUX_CUDA_TRY(cudaMemsetAsync(p.out, 0xFF, out_bytes, S));

  const size_t parity_offset = (ws->epoch & 1) * (ws->slots_capacity / 2);  // >= tp * chunk_bytes
  CollectiveArgs a{};
  a.x = static_cast<const uint4*>(p.x);
  a.out = static_cast<uint4*>(p.out);
  for (int q = 0; q < tp; ++q) {
    if (q == r) continue;
    a.peer_slot[q] = reinterpret_cast<uint4*>(ws->peers[q].slots + parity_offset + r * chunk_bytes);
    a.peer_flag[q] = ws->peers[q].block_arrived + r * kMaxLatencyBlocks;
  }
  a.my_slots = reinterpret_cast<const uint4*>(ws->slots + parity_offset);
  a.my_flags = ws->block_arrived;
  a.chunk_vecs = static_cast<int64_t>(chunk_bytes / sizeof(uint4));
  a.tp = tp;
  a.rank = r;
  a.signal = cfg.drop_rank != r;
  a.site = kind == Kind::kAllGather ? kSiteAllGather : kSiteReduceScatter;
  a.ctx = ws->Wait(cfg.timeout_us);
  const int64_t want = (static_cast<int64_t>(chunk_bytes) + kMinBytesPerBlock - 1) / kMinBytesPerBlock;
  const int blocks = static_cast<int>(std::clamp<int64_t>(want, 1, std::min(kMaxLatencyBlocks, ws->sm_count)));
  if (kind == Kind::kAllGather) {
    AllGatherKernel<<<blocks, kThreads, 0, S>>>(a);
  } else if (p.dtype == DType::kBF16) {
    ReduceScatterKernel<__nv_bfloat16><<<blocks, kThreads, 0, S>>>(a);
  } else {
    ReduceScatterKernel<__half><<<blocks, kThreads, 0, S>>>(a);
  }
  FLUX_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace

Status PreloadLatencyCollectives() {
  cudaFuncAttributes attrs;
  FLUX_CUDA_TRY(cudaFuncGetAttributes(&attrs, AllGatherKernel));
  FLUX_CUDA_TRY(cudaFuncGetAttributes(&attrs, ReduceScatterKernel<__nv_bfloat16>));
  FLUX_CUDA_TRY(cudaFuncGetAttributes(&attrs, ReduceScatterKernel<__half>));
  FLUX_CUDA_TRY(cudaFuncGetAttributes(&attrs, AllReduceKernel<__nv_bfloat16>));
  FLUX_CUDA_TRY(cudaFuncGetAttributes(&attrs, AllReduceKernel<__half>));
  return Status::Ok();
}

Status EnqueueAllReduce(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t S,
                        const PartialWriter& write_partial) {
  if (p.dtype == DType::kF32) {
    return Status::InvalidArgument("all_reduce: the CUDA kernel takes bfloat16 or float16");
  }
  const int tp = group.size, r = group.rank;
  DeviceGuard guard(group.ordinals[r]);
  const size_t bytes = static_cast<size_t>(p.rows * p.cols) * DTypeBytes(p.dtype);
  if (bytes % sizeof(uint4) != 0 || reinterpret_cast<uintptr_t>(p.out) % 16 ||
      (!write_partial && reinterpret_cast<uintptr_t>(p.x) % 16)) {
    return Status::InvalidArgument("all_reduce: rows of " + std::to_string(p.cols) +
                                   " elements are not a multiple of 16 bytes (need cols % 8 == 0)");
  }
  if (tp > kMaxPeers) {
    return Status::InvalidArgument("all_reduce: the latency path supports TP <= " + std::to_string(kMaxPeers) +
                                   ", got " + std::to_string(tp));
  }
  // Nothing to move (every rank has the same empty shape): no kernel and no epoch (see above).
  if (bytes == 0) return Status::Ok();
  if (tp == 1) {
    if (write_partial) {
      GroupWorkspace* ws = nullptr;  // no communication; the workspace holds the GEMM's alpha
      FLUX_JAX_RETURN_IF_ERROR(AcquireWorkspace(group, 0, cfg, S, &ws));
      if (cfg.poison_outputs) FLUX_CUDA_TRY(cudaMemsetAsync(p.out, 0xFF, bytes, S));
      return write_partial(*ws, p.out);
    }
    FLUX_CUDA_TRY(cudaMemcpyAsync(p.out, p.x, bytes, cudaMemcpyDeviceToDevice, S));
    return Status::Ok();
  }
  // Each parity half of the slot area holds tp slots of the whole partial: the peers' and,
  // for a written partial, this rank's own.
  GroupWorkspace* ws = nullptr;
  FLUX_JAX_RETURN_IF_ERROR(AcquireWorkspace(group, 0, cfg, S, &ws, 2 * tp * bytes));
  ws->epoch += 1;  // every rank counts every fused call of the group: epochs agree
  if (cfg.poison_outputs) FLUX_CUDA_TRY(cudaMemsetAsync(p.out, 0xFF, bytes, S));

  const size_t parity_offset = (ws->epoch & 1) * (ws->slots_capacity / 2);  // >= tp * bytes
  const void* x = p.x;
  if (write_partial) {
    // This rank's own slot: peers write only the slots of their own ranks, and the kernel that
    // last read this one (call epoch - 2) ran earlier on this stream.
    void* partial = ws->slots + parity_offset + r * bytes;
    FLUX_JAX_RETURN_IF_ERROR(write_partial(*ws, partial));
    x = partial;
  }
  CollectiveArgs a{};
  a.x = static_cast<const uint4*>(x);
  a.out = static_cast<uint4*>(p.out);
  for (int q = 0; q < tp; ++q) {
    if (q == r) continue;
    a.peer_slot[q] = reinterpret_cast<uint4*>(ws->peers[q].slots + parity_offset + r * bytes);
    a.peer_flag[q] = ws->peers[q].block_arrived + r * kMaxLatencyBlocks;
  }
  a.my_slots = reinterpret_cast<const uint4*>(ws->slots + parity_offset);
  a.my_flags = ws->block_arrived;
  a.chunk_vecs = static_cast<int64_t>(bytes / sizeof(uint4));
  a.tp = tp;
  a.rank = r;
  a.signal = cfg.drop_rank != r;
  a.site = kSiteAllReduce;
  a.ctx = ws->Wait(cfg.timeout_us);
  const int64_t want = (static_cast<int64_t>(bytes) + kMinBytesPerBlock - 1) / kMinBytesPerBlock;
  const int blocks = static_cast<int>(std::clamp<int64_t>(want, 1, std::min(kMaxLatencyBlocks, ws->sm_count)));
  if (p.dtype == DType::kBF16) {
    AllReduceKernel<__nv_bfloat16><<<blocks, kThreads, 0, S>>>(a);
  } else {
    AllReduceKernel<__half><<<blocks, kThreads, 0, S>>>(a);
  }
  FLUX_CUDA_TRY(cudaGetLastError());
  return Status::Ok();
}

}  // namespace flux_jax::cuda

namespace flux_jax {

Status RunAllGatherCuda(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg, void* stream) {
  FLUX_JAX_RETURN_IF_ERROR(AllGatherCanImplement(p, group));
  return cuda::Run(cuda::Kind::kAllGather, p, group, cfg, stream);
}

Status RunReduceScatterCuda(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg, void* stream) {
  FLUX_JAX_RETURN_IF_ERROR(ReduceScatterCanImplement(p, group));
  return cuda::Run(cuda::Kind::kReduceScatter, p, group, cfg, stream);
}

Status RunAllReduceCuda(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg, void* stream) {
  FLUX_JAX_RETURN_IF_ERROR(AllReduceCanImplement(p, group));
  return cuda::EnqueueAllReduce(p, group, cfg, static_cast<cudaStream_t>(stream), nullptr);
}

}  // namespace flux_jax
