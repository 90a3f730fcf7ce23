// Stream-ordered operations that use no SMs (so they can never be starved by a
// persistent GEMM that occupies every SM), plus the one tiny wait kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device_sync.cuh"
#include "flux_jax/status.h"

namespace flux_jax::cuda {

// *addr = value when `stream` reaches this point (cuStreamWriteValue64: done
// by the GPU front end, not by an SM). `addr` is this device's memory.
Status StreamWriteValue64(cudaStream_t stream, uint64_t* addr, uint64_t value);

// One warp: lane p waits until present[p] >= ctx.epoch for every peer p != rank
// (bounded by ctx.timeout_ns). The compute stream runs this before a fused
// GEMM, so no GEMM occupies the SMs before every peer has reached the op.
Status LaunchWaitPeersPresent(cudaStream_t stream, const uint64_t* present, int tp,
                              const WaitContext& ctx);

// Loads the wait kernel into the current device's context (see PreloadGemmKernels).
Status PreloadStreamOps();

}  // namespace flux_jax::cuda
