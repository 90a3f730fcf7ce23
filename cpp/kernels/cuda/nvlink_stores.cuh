// Device pieces of the kernels that move rows with SM stores over NVLink: the
// latency collectives (latency_collectives.cu) and the decode path's row push
// (ag_matmul_decode.cu).
#pragma once

#include <cstdint>

namespace flux_jax::cuda {

// How a block publishes its stores to other GPUs (NCCL's simple protocol does the same):
//
//   every thread: stores (NVLink or local)
//   __syncthreads()                    orders them before thread 0's fence (CTA scope)
//   thread 0: FenceAcqRelSys()         cumulative: covers the whole block's stores
//             StoreRelaxedSys(flag_q, epoch) for each reader q
//
// A reader's ld.acquire.sys of the flag then sees the data. Measured with a
// push probe (2x H200, both GPUs pushing 512 KiB to each other, 32 blocks of
// 512 threads; docs/decisions/2026-11-30-nvlink-push-fence.md): 5.1 us per push against 7.7 us with a
// fence.sc.sys (__threadfence_system) in every thread and a st.release.sys per
// flag (each compiles to its own MEMBAR.SYS), and 3.6 us with no fence at all.
__device__ __forceinline__ void FenceAcqRelSys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// A flag write after FenceAcqRelSys (no fence of its own).
__device__ __forceinline__ void StoreRelaxedSys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// This block's share [lo, hi) of `vecs` 16-byte vectors: every rank launches the
// same grid over the same chunk, so block i owns the same range on every rank.
__device__ __forceinline__ void BlockRange(int64_t vecs, int64_t* lo, int64_t* hi) {
  const int64_t blocks = gridDim.x, block = blockIdx.x;
  const int64_t per = (vecs + blocks - 1) / blocks;
  *lo = per * block < vecs ? per * block : vecs;
  *hi = *lo + per < vecs ? *lo + per : vecs;
}

// Calls load(v) for up to kBatch vectors of this thread in [lo, hi), then
// store(v, value) for each: every load of a batch is issued before the first
// store (the compiler cannot reorder them itself: the pointers may alias).
// kThreads: the block size the kernel is launched with.
template <int kThreads, int kBatch, class Load, class Store>
__device__ __forceinline__ void BatchedCopy(int64_t lo, int64_t hi, Load load, Store store) {
  for (int64_t base = lo + threadIdx.x; base < hi; base += int64_t{kThreads} * kBatch) {
    uint4 val[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t v = base + int64_t{u} * kThreads;
      if (v < hi) val[u] = load(v);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t v = base + int64_t{u} * kThreads;
      if (v < hi) store(v, val[u]);
    }
  }
}

}  // namespace flux_jax::cuda
