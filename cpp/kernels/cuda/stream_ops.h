// Stream-ordered operations: a value write that uses no SM (so it can never be
// starved by a persistent GEMM that occupies every SM), and the presence
// handshake, one warp that runs before our GEMM takes the SMs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device_sync.cuh"
#include "flux_jax/status.h"

namespace flux_jax::cuda {

inline constexpr int kMaxPresenceRanks = 32;  // one lane per rank

// *addr = value when `stream` reaches this point (cuStreamWriteValue64: done
// by the GPU front end, not by an SM). `addr` is this device's memory.
Status StreamWriteValue64(cudaStream_t stream, uint64_t* addr, uint64_t value);

// `stream` waits until *addr >= value (cuStreamWaitValue64, GEQ; the GPU front end polls).
// Unbounded: only for cells that our own GEMM raises whatever its peers do (the tile
// counters of an ungated launch, TileSignal), never for a peer's flag.
Status StreamWaitValue64Geq(cudaStream_t stream, const uint64_t* addr, uint64_t value);

// Where a rank announces that it reached a fused op: peer_slot[p] is rank p's
// present[rank] (through peer access or CUDA IPC); null where p == rank.
struct PresenceSignal {
  uint64_t* peer_slot[kMaxPresenceRanks] = {};
  bool signal = true;  // false: debug_drop_rank (this rank never shows up)
};

// One warp, lane p for peer p != rank: peer_slot[p] = ctx.epoch (st.release.sys,
// over NVLink), then wait until present[p] >= ctx.epoch (bounded by
// ctx.timeout_ns). The compute stream runs this before a fused GEMM, so no GEMM
// occupies the SMs before every peer has reached the op. One launch: the
// announcement used to be a copy-engine write, which put ~4-5 us of copy
// latency on the critical path of every call.
Status LaunchPresenceHandshake(cudaStream_t stream, const PresenceSignal& signal, const uint64_t* present, int tp,
                               const WaitContext& ctx);

// The `return_gathered` copies after a GEMM that waited for the rows they copy:
// dst[b] = src[b] for the bytes b of [0, bytes) outside [skip_lo, skip_hi), or
// NaN (all bits set, in bfloat16 and float16) for all of them if *alpha is NaN:
// a wait of this member gave up, so rows it guarded may be stale or torn (its
// GEMM's output is NaN for the same reason). One kernel on `stream`, after the
// GEMM; every size and offset a multiple of 16 bytes.
Status LaunchCopyUnlessPoisoned(cudaStream_t stream, void* dst, const void* src, int64_t bytes, int64_t skip_lo,
                                int64_t skip_hi, const float* alpha, int sm_count);

// Loads the handshake kernel into the current device's context (see PreloadGemmKernels).
Status PreloadStreamOps();

}  // namespace flux_jax::cuda
