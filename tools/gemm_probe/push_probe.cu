// Times the decode path's row push (ag_matmul_decode.cu's PushRowsKernel) alone on two GPUs, and
// variants of it, to find where its ~8 us at 512 KiB (session 16's profile) go:
//
//   GPU g, its own stream, both GPUs at once, iteration e:
//     push<<<B, T>>>(e):  x[chunk] -> G on GPU g and on the peer (NVLink stores or TMA bulk),
//                         fence.sys, flags = e on both GPUs (per block, or once by the last block)
//     [wait<<<1, 32>>>(e): spin until the peer's flags of e are here]    (mode "push+wait")
//
// "push" is the push kernel back to back (its throughput); "push+wait" adds the wait for the
// peer's flags, i.e. the time until a GEMM could start on the gathered rows. Every variant runs
// in the same process; the best of 5 loops of 200 iterations is printed (16 bytes: the floor of a
// launch, a fence and a flag). The first iteration's gathered rows are checked against x on both
// GPUs (poisoned before). kBarFenceAcqRel is what the library ships (nvlink_stores.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "nvlink_stores.cuh"

#define CHECK(x)                                                                          \
  do {                                                                                    \
    cudaError_t err_ = (x);                                                               \
    if (err_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

namespace {

constexpr int kFlags = 256;

struct PushArgs {
  const uint4* x;
  uint4* dst[2];       // own G, peer G (same offset: this GPU's chunk)
  uint64_t* flag[2];   // own flags, peer flags (this GPU's row of them)
  unsigned* counter;   // local, zero between launches (last-block mode)
  int64_t vecs;
  uint64_t epoch;
  bool local;          // also write the own copy
  bool last_block;     // one flag per GPU, raised by the block that finishes last
  int fence;           // a Fence value
};

// How a block publishes its stores before the flag.
enum Fence {
  kEveryThreadMembarSys = 0,  // main: every thread fence.sc.sys, bar.sync, st.release.sys
  kBarRelease = 1,            // bar.sync, then thread 0's st.release.sys alone (cumulativity)
  kBarFenceAcqRel = 2,        // bar.sync, thread 0 fence.acq_rel.sys, st.relaxed.sys
  kNoFenceVolatile = 3,       // floor: bar.sync, st.volatile (NOT ordered: timing only)
  kNoFlag = 4,                // floor: no flag at all (push+wait not run)
  kBarMembarSys = 5,          // bar.sync, thread 0 fence.sc.sys, st.release.sys
};

__device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Writes one flag the way the variant's Fence says.
__device__ __forceinline__ void RaiseFlag(const PushArgs& a, uint64_t* p) {
  if (a.fence == kNoFenceVolatile) {
    *reinterpret_cast<volatile uint64_t*>(p) = a.epoch;
  } else if (a.fence == kBarFenceAcqRel) {
    flux_jax::cuda::StoreRelaxedSys(p, a.epoch);
  } else {
    StoreReleaseSys(p, a.epoch);
  }
}

// Raises the flags once this block's stores are visible system-wide: every block's own flag, or
// (last_block) one flag after the last block to finish has seen all others' fences.
__device__ __forceinline__ void Publish(const PushArgs& a) {
  if (a.fence == kNoFlag) return;
  if (a.fence == kEveryThreadMembarSys) __threadfence_system();
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (a.fence == kBarMembarSys) __threadfence_system();
  if (a.fence == kBarFenceAcqRel) flux_jax::cuda::FenceAcqRelSys();
  if (a.last_block) {
    unsigned prev;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(prev) : "l"(a.counter) : "memory");
    if (prev + 1 != gridDim.x) return;
    *a.counter = 0;
    for (int q = 0; q < 2; ++q) RaiseFlag(a, a.flag[q]);
    return;
  }
  for (int q = 0; q < 2; ++q) RaiseFlag(a, a.flag[q] + blockIdx.x);
}

template <int kThreads, int kBatch>
__global__ void __launch_bounds__(kThreads) StorePush(PushArgs a) {
  const int64_t per = (a.vecs + gridDim.x - 1) / gridDim.x;
  const int64_t lo = min(per * blockIdx.x, a.vecs), hi = min(lo + per, a.vecs);
  for (int64_t base = lo + threadIdx.x; base < hi; base += int64_t{kThreads} * kBatch) {
    uint4 v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (base + u * kThreads < hi) v[u] = __ldg(a.x + base + u * kThreads);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (base + u * kThreads < hi) {
        a.dst[1][base + u * kThreads] = v[u];
        if (a.local) a.dst[0][base + u * kThreads] = v[u];
      }
    }
  }
  Publish(a);
}

// TMA bulk copies: the block's range through shared memory in pieces of kPiece bytes, one thread
// issuing, stored to both GPUs by cp.async.bulk.
constexpr int kPiece = 32 << 10;
__global__ void __launch_bounds__(32) TmaPush(PushArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bar;
  const int64_t bytes = a.vecs * 16;
  const int64_t per = ((bytes + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
  const int64_t lo = min(per * blockIdx.x, bytes), hi = min(lo + per, bytes);
  if (threadIdx.x == 0) {
    const unsigned b = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(b));
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    unsigned phase = 0;
    for (int64_t off = lo; off < hi; off += kPiece) {
      const unsigned n = static_cast<unsigned>((hi - off < kPiece ? hi - off : int64_t{kPiece}));
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // smem free again
      asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(b), "r"(n) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(s),
                   "l"(reinterpret_cast<const char*>(a.x) + off), "r"(n), "r"(b)
                   : "memory");
      asm volatile(
          "{ .reg .pred p; W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1; @!p bra W; }" ::"r"(b), "r"(phase)
          : "memory");
      phase ^= 1;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                       reinterpret_cast<char*>(a.dst[1]) + off),
                   "r"(s), "r"(n)
                   : "memory");
      if (a.local) {
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                         reinterpret_cast<char*>(a.dst[0]) + off),
                     "r"(s), "r"(n)
                     : "memory");
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  Publish(a);
}

__global__ void WaitFlags(const uint64_t* flags, int count, uint64_t epoch) {
  for (int i = threadIdx.x; i < count; i += 32) {
    while (LoadAcquireSys(flags + i) < epoch) {
    }
  }
}

struct Gpu {
  cudaStream_t s;
  uint4* x;
  uint4* g;           // [2 chunks]
  uint64_t* flags;    // [2 senders][kFlags]
  unsigned* counter;
};

struct Variant {
  const char* name;
  int kind;  // 0: stores, 1: TMA
  int threads, batch;
  int64_t bytes_per_block;
  bool local, last_block;
  int fence;
};

using Launch = void (*)(int blocks, cudaStream_t s, const PushArgs& a);

template <int T, int B>
void LaunchStores(int blocks, cudaStream_t s, const PushArgs& a) {
  StorePush<T, B><<<blocks, T, 0, s>>>(a);
}
void LaunchTma(int blocks, cudaStream_t s, const PushArgs& a) { TmaPush<<<blocks, 32, kPiece, s>>>(a); }

Launch Pick(const Variant& v) {
  if (v.kind == 1) return LaunchTma;
  if (v.threads == 512 && v.batch == 4) return LaunchStores<512, 4>;
  if (v.threads == 256 && v.batch == 4) return LaunchStores<256, 4>;
  if (v.threads == 256 && v.batch == 2) return LaunchStores<256, 2>;
  if (v.threads == 128 && v.batch == 4) return LaunchStores<128, 4>;
  if (v.threads == 1024 && v.batch == 1) return LaunchStores<1024, 1>;
  std::fprintf(stderr, "no instance for %d threads, batch %d\n", v.threads, v.batch);
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  int ndev = 0;
  CHECK(cudaGetDeviceCount(&ndev));
  if (ndev < 2) {
    std::fprintf(stderr, "push_probe needs 2 GPUs\n");
    return 1;
  }
  const int64_t max_bytes = 4 << 20;
  Gpu gpu[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaDeviceEnablePeerAccess(1 - d, 0));
    CHECK(cudaStreamCreateWithFlags(&gpu[d].s, cudaStreamNonBlocking));
    CHECK(cudaMalloc(&gpu[d].x, max_bytes));
    CHECK(cudaMalloc(&gpu[d].g, 2 * max_bytes));
    CHECK(cudaMalloc(&gpu[d].flags, 2 * kFlags * sizeof(uint64_t)));
    CHECK(cudaMalloc(&gpu[d].counter, sizeof(unsigned)));
    CHECK(cudaMemset(gpu[d].flags, 0, 2 * kFlags * sizeof(uint64_t)));
    CHECK(cudaMemset(gpu[d].counter, 0, sizeof(unsigned)));
    std::vector<uint32_t> host(max_bytes / 4);
    for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint32_t>(i * 2654435761u + d * 97u + 1);
    CHECK(cudaMemcpy(gpu[d].x, host.data(), max_bytes, cudaMemcpyHostToDevice));
    CHECK(cudaFuncSetAttribute(TmaPush, cudaFuncAttributeMaxDynamicSharedMemorySize, kPiece));
  }
  const Variant variants[] = {
      {"stores 512x4 16K/blk flag/blk (main)", 0, 512, 4, 16 << 10, true, false, kEveryThreadMembarSys},
      {"  same, bar + release", 0, 512, 4, 16 << 10, true, false, kBarRelease},
      {"  same, bar + t0 membar.sys + release", 0, 512, 4, 16 << 10, true, false, kBarMembarSys},
      {"  same, bar + t0 fence.acq_rel.sys", 0, 512, 4, 16 << 10, true, false, kBarFenceAcqRel},
      {"  same, floor: volatile flag, no fence", 0, 512, 4, 16 << 10, true, false, kNoFenceVolatile},
      {"  same, floor: no flag", 0, 512, 4, 16 << 10, true, false, kNoFlag},
      {"stores 512x4 16K/blk peer only", 0, 512, 4, 16 << 10, false, false, kEveryThreadMembarSys},
      {"stores 256x4 8K/blk last-block", 0, 256, 4, 8 << 10, true, true, kEveryThreadMembarSys},
      {"  same, bar + release", 0, 256, 4, 8 << 10, true, true, kBarRelease},
      {"  same, bar + t0 membar.sys + release", 0, 256, 4, 8 << 10, true, true, kBarMembarSys},
      {"stores 1024x1 16K/blk last-block, bar+rel", 0, 1024, 1, 16 << 10, true, true, kBarRelease},
      {"stores 128x4 4K/blk last-block, bar+rel", 0, 128, 4, 4 << 10, true, true, kBarRelease},
      {"tma 32K/blk last-block, bar+rel", 1, 32, 1, 32 << 10, true, true, kBarRelease},
      {"tma 8K/blk last-block, bar+rel", 1, 32, 1, 8 << 10, true, true, kBarRelease},
  };
  const int64_t sizes[] = {16, 128 << 10, 512 << 10, 1 << 20, 2 << 20};
  uint64_t epoch = 0;
  cudaEvent_t e0[2], e1[2];
  for (int d = 0; d < 2; ++d) {
    CHECK(cudaSetDevice(d));
    CHECK(cudaEventCreate(&e0[d]));
    CHECK(cudaEventCreate(&e1[d]));
  }
  std::printf("%-42s %8s %6s %12s %12s %10s\n", "variant", "bytes", "blocks", "push_us", "push+wait_us",
              "check");
  for (const int64_t bytes : sizes) {
    for (const Variant& v : variants) {
      const int blocks = static_cast<int>(std::min<int64_t>(kFlags, (bytes + v.bytes_per_block - 1) / v.bytes_per_block));
      const Launch launch = Pick(v);
      auto args = [&](int d, uint64_t e) {
        PushArgs a{};
        a.x = gpu[d].x;
        a.dst[0] = gpu[d].g + d * (bytes / 16);
        a.dst[1] = gpu[1 - d].g + d * (bytes / 16);
        a.flag[0] = gpu[d].flags + d * kFlags;
        a.flag[1] = gpu[1 - d].flags + d * kFlags;
        a.counter = gpu[d].counter;
        a.vecs = bytes / 16;
        a.epoch = e;
        a.local = v.local;
        a.last_block = v.last_block;
        a.fence = v.fence;
        return a;
      };
      // Correctness: poison G, one push + wait, compare both chunks on both GPUs.
      for (int d = 0; d < 2; ++d) {
        CHECK(cudaSetDevice(d));
        CHECK(cudaMemset(gpu[d].g, 0xEE, 2 * bytes));
        CHECK(cudaDeviceSynchronize());
      }
      ++epoch;
      for (int d = 0; d < 2; ++d) {
        CHECK(cudaSetDevice(d));
        launch(blocks, gpu[d].s, args(d, epoch));
        const int count = v.fence == kNoFlag ? 0 : v.last_block ? 1 : blocks;
        WaitFlags<<<1, 32, 0, gpu[d].s>>>(gpu[d].flags + (1 - d) * kFlags, count, epoch);
      }
      for (int d = 0; d < 2; ++d) {
        CHECK(cudaSetDevice(d));
        CHECK(cudaStreamSynchronize(gpu[d].s));
        CHECK(cudaGetLastError());
      }
      bool ok = true;
      for (int d = 0; d < 2; ++d) {
        CHECK(cudaSetDevice(d));
        std::vector<char> got(2 * bytes), want(bytes);
        CHECK(cudaMemcpy(got.data(), gpu[d].g, 2 * bytes, cudaMemcpyDeviceToHost));
        for (int src = 0; src < 2; ++src) {
          if (!v.local && src == d) continue;
          CHECK(cudaSetDevice(src));
          CHECK(cudaMemcpy(want.data(), gpu[src].x, bytes, cudaMemcpyDeviceToHost));
          if (std::memcmp(got.data() + src * bytes, want.data(), bytes) != 0) ok = false;
          CHECK(cudaSetDevice(d));
        }
      }
      // Timing: 200 iterations per GPU captured into one graph each (host launch rate out of the
      // loop), both graphs launched together; the best of 5 rounds after a warm-up round.
      float best[2] = {1e30f, 1e30f};
      for (int with_wait = 0; with_wait < (v.fence == kNoFlag ? 1 : 2); ++with_wait) {
        const int iters = 200;
        for (int round = 0; round < 6; ++round) {
          cudaGraphExec_t exec[2];
          for (int d = 0; d < 2; ++d) {
            CHECK(cudaSetDevice(d));
            cudaGraph_t graph;
            CHECK(cudaStreamBeginCapture(gpu[d].s, cudaStreamCaptureModeThreadLocal));
            for (int i = 1; i <= iters; ++i) {
              launch(blocks, gpu[d].s, args(d, epoch + i));
              if (with_wait) {
                WaitFlags<<<1, 32, 0, gpu[d].s>>>(gpu[d].flags + (1 - d) * kFlags, v.last_block ? 1 : blocks,
                                                  epoch + i);
              }
            }
            CHECK(cudaStreamEndCapture(gpu[d].s, &graph));
            CHECK(cudaGraphInstantiate(&exec[d], graph, 0));
            CHECK(cudaGraphDestroy(graph));
          }
          epoch += iters;
          for (int d = 0; d < 2; ++d) {
            CHECK(cudaSetDevice(d));
            CHECK(cudaEventRecord(e0[d], gpu[d].s));
            CHECK(cudaGraphLaunch(exec[d], gpu[d].s));
            CHECK(cudaEventRecord(e1[d], gpu[d].s));
          }
          for (int d = 0; d < 2; ++d) {
            CHECK(cudaSetDevice(d));
            CHECK(cudaEventSynchronize(e1[d]));
            float ms = 0;
            CHECK(cudaEventElapsedTime(&ms, e0[d], e1[d]));
            if (round > 0) best[with_wait] = std::min(best[with_wait], ms * 1000 / iters);
            CHECK(cudaGraphExecDestroy(exec[d]));
          }
        }
      }
      std::printf("%-42s %8lld %6d %12.2f %12.2f %10s\n", v.name, static_cast<long long>(bytes), blocks, best[0],
                  best[1], ok ? "ok" : "MISMATCH");
      std::fflush(stdout);
    }
  }
  return 0;
}
