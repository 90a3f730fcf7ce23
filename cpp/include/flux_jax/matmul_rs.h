// Host API of the fused GEMM -> ReduceScatter op (one entry point per backend).
#pragma once

#include "flux_jax/params.h"
#include "flux_jax/status.h"

namespace flux_jax {

Status MatmulRsCanImplement(const MatmulRsParams& p, const TpGroup& group);

// CPU backend: deterministic, sums the partials in rank order 0..tp-1.
Status RunMatmulRsCpu(const MatmulRsParams& p, const TpGroup& group, const CommConfig& cfg);

// CUDA backend (only when built with CUDA): enqueues on `stream`.
Status RunMatmulRsCuda(const MatmulRsParams& p, const TpGroup& group, const CommConfig& cfg, void* stream);

}  // namespace flux_jax
