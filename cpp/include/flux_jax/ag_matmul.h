// Host API of the fused AllGather -> GEMM op (one entry point per backend).
#pragma once

#include "flux_jax/params.h"
#include "flux_jax/status.h"

namespace flux_jax {

// Shape/dtype checks shared by every backend.
Status AgMatmulCanImplement(const AgMatmulParams& p, const TpGroup& group);

// CPU backend: runs on the calling thread (one per device), blocking waits.
Status RunAgMatmulCpu(const AgMatmulParams& p, const TpGroup& group, const CommConfig& cfg);

// CUDA backend (only when built with CUDA): enqueues on `stream`.
Status RunAgMatmulCuda(const AgMatmulParams& p, const TpGroup& group, const CommConfig& cfg, void* stream);

}  // namespace flux_jax
