// The latency path's all_reduce (latency_collectives.cu) as a building block of
// matmul_ar's one-custom-call path (matmul_ar_cuda.cc).
#pragma once

#include <cuda_runtime.h>

#include <functional>

#include "flux_jax/collectives.h"
#include "workspace.h"

namespace flux_jax::cuda {

// Enqueues on `stream` what writes this rank's partial [rows, cols] into `partial`.
using PartialWriter = std::function<Status(GroupWorkspace& ws, void* partial)>;

// out = the rank-ordered float32 sum over the group of each rank's partial, rounded once.
// Without `write_partial` the partial is p.x (the all_reduce custom call). With it, p.x is
// ignored: `write_partial` writes the partial into this rank's own slot of the call's parity
// (no peer ever writes there: peers write the slots of their own ranks), and the kernel reads
// it from there; with tp == 1 it writes straight into p.out.
Status EnqueueAllReduce(const CollectiveParams& p, const TpGroup& group, const CommConfig& cfg, cudaStream_t stream,
                        const PartialWriter& write_partial);

}  // namespace flux_jax::cuda
